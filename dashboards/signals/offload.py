"""KV beyond the GPU pool: where cached prompt tokens come from, and the offload tiers (CPU, disk, remote)."""

from __future__ import annotations

from kvcache_exporter.contract import WHAT_IF_FACTORS
from kvcache_exporter.dashboards import bands, promql
from kvcache_exporter.dashboards.panels import Query, describe, no_value_without_source, timeseries, without_source
from kvcache_exporter.dashboards.signals.prefix_cache import QUERIED
from kvcache_exporter.dashboards.view import (BLOCKS, BYTES_PER_SECOND, FAILURES_PER_SECOND, RATIO, SECONDS, TOKENS,
                                              TOKENS_PER_SECOND, View)

CACHED = "kvcache_cached_prompt_tokens_total"
CAPACITY = "kvcache_tier_capacity_tokens"
USED = "kvcache_tier_used_tokens"
TRANSFER_BYTES = "kvcache_tier_transfer_bytes_total"
TRANSFER_TOKENS = "kvcache_tier_transfer_tokens_total"
TRANSFER_SECONDS = "kvcache_tier_transfer_seconds_total"
STORE_FAILURES = "kvcache_tier_store_failures_total"
# From the KV event stream (exporter/tiers.py): the tiers' own stores and evictions, and the blocks they served.
SERVED = "kvcache_tier_served_blocks_total"
TIER_RESIDENT = "kvcache_tier_blocks_resident"
TIER_MISSES = "kvcache_tier_capacity_miss_blocks_total"
TIER_DISTANCE = "kvcache_tier_capacity_miss_distance_ratio"
TIER_STREAM_ONLY = ("Present only for targets whose KV event stream the exporter reads (`kv_events:`) and whose "
                    "engine publishes its tier's events (vLLM's offloading connector, medium CPU; SGLang's HiCache, "
                    "CPU_PINNED), docs/kv-events.md.")
# A rate above this is at least one refused store in the window: red.
ANY_FAILURE_PER_SECOND = 0.001
ONLY_WITH_A_TIER = "Present only on engines with an offload tier (vLLM's native CPU offload, SGLang's HiCache)."
PRESSURE_NOTE = ("The pressure state stays the GPU pool's: a full tier does not fill the GPU pool, it stops "
                 "relieving it.")


def hit_ratio_by_source(v: View):
    return timeseries(
        "Prefix hits by source",
        describe(
            "Share of the prompt tokens looked up that came from a cache, by where the KV was: gpu (the pool), "
            "cpu, disk, remote (offload tiers and external caches), peer (another engine instance: disaggregated "
            "prefill), other; and all sources together: "
            "sum by (source) (rate(cached prompt tokens)) / sum(rate(queried tokens)) over the whole selection. "
            "Hits from an offload tier are prefill not computed again, though loaded over PCIe or the network."
            + without_source(CACHED.removeprefix("kvcache_")),
            "no absolute red (it depends on the workload). A falling cpu or disk share with a steady gpu share "
            "means the tier no longer keeps the working set (Offload tier usage, Store failures).",
        ),
        RATIO,
        [Query(promql.rate_share_by(v.scope, CACHED, QUERIED, "source"), "{{source}}"),
         Query(promql.rate_ratio(v.scope, CACHED, QUERIED), "all sources")],
        bands.neutral(),
        min_max=(0, 1),
        no_value=no_value_without_source(CACHED.removeprefix("kvcache_")),
    )


def tier_usage(v: View):
    by = (*v.split, "tier")
    return timeseries(
        f"Offload tier usage {v.per}",
        describe(
            "Used tokens / capacity tokens of each offload tier: sum(used) / sum(capacity). vLLM counts only "
            "what cannot be evicted (chunks pinned by transfers in flight); SGLang counts all the tier holds. "
            + ONLY_WITH_A_TIER + " " + PRESSURE_NOTE,
            "near 100% on vLLM the tier is pinned by transfers and refuses stores (Store failures); on SGLang a "
            "full tier is normal (it evicts least-recently-used) unless its hit share falls.",
        ),
        RATIO,
        [Query(promql.gauge_ratio(v.scope, USED, CAPACITY, by), v.line("{{tier}}"))],
        bands.neutral(),
        v.drill_down,
        min_max=(0, 1),
    )


def tier_tokens(v: View):
    by = ("tier",)
    return timeseries(
        "Offload tier size",
        describe("Capacity and used tokens of each offload tier over the whole selection. " + ONLY_WITH_A_TIER,
                 "no red band: it sizes the tier against the GPU pool (KV capacity)."),
        TOKENS,
        [Query(promql.total(v.scope, CAPACITY, by), "{{tier}} capacity"),
         Query(promql.total(v.scope, USED, by), "{{tier}} used")],
        bands.neutral(),
    )


def _transfers(v: View, counter: str, what: str, unit: str, counts: str):
    return timeseries(
        f"Offload load and store ({what})",
        describe(
            f"{what.capitalize()} moved per second between the GPU pool and each tier over the whole selection, "
            f"{counts}: load (tier to GPU: hits served from the tier), store (GPU to tier)."
            + without_source(counter.removeprefix("kvcache_")),
            "no red band. Stores far above loads: the tier keeps KV that is rarely asked for again.",
        ),
        unit,
        [Query(promql.rate(v.scope, counter, ("tier", "direction")), "{{tier}} {{direction}}")],
        bands.neutral(),
        no_value=no_value_without_source(counter.removeprefix("kvcache_")),
    )


def transfer_bytes(v: View):
    return _transfers(v, TRANSFER_BYTES, "bytes", BYTES_PER_SECOND,
                      "where the engine counts bytes (vLLM; SGLang's host tier)")


def transfer_tokens(v: View):
    return _transfers(v, TRANSFER_TOKENS, "tokens", TOKENS_PER_SECOND, "where the engine counts tokens (SGLang)")


def load_seconds_per_token(v: View):
    t = v.thresholds
    by = (*v.split, "tier")
    loaded = promql.summed(
        f"{promql.windowed(v.scope, TRANSFER_TOKENS, direction='load')} or "
        f"{promql.windowed(v.scope, TRANSFER_BYTES, direction='load')} / ignoring (tier, direction) group_left "
        f"{v.selector('kvcache_bytes_per_token')}", by)
    return timeseries(
        f"Load-back time per token {v.per}",
        describe(
            "Seconds spent loading one token back from each tier: transfer seconds / tokens loaded over the "
            "rate interval (vLLM counts bytes, turned into tokens with the target's bytes per token, so its "
            "line needs the model architecture in the exporter's configuration). " + ONLY_WITH_A_TIER,
            f"above {t.offload_load_max_seconds_per_token:g} s (offload_load_max_seconds_per_token, about what "
            "recomputing a token's prefill costs) loading back is slower than recomputing "
            "(KVCacheOffloadLoadSlow): a tier on slow media or a congested host link.",
        ),
        SECONDS,
        [Query(promql.ratio(promql.rate(v.scope, TRANSFER_SECONDS, by, direction="load"), loaded),
               v.line("{{tier}}"))],
        ((None, "green"), (t.offload_load_max_seconds_per_token, "red")),
        v.drill_down,
    )


def store_failures(v: View):
    by = (*v.split, "tier")
    return timeseries(
        f"Offload store failures {v.per}",
        describe(
            "Stores per second an offload tier refused for want of room (vLLM allocation failures): the tier "
            "is full of KV it cannot evict." + without_source(STORE_FAILURES.removeprefix("kvcache_")),
            "any: what the GPU pool evicts is now lost and recomputed on its next hit. With requests queueing "
            "for KV it is KVCacheOffloadTierFull: grow the tier, or check that transfers keep up.",
        ),
        FAILURES_PER_SECOND,
        [Query(promql.rate(v.scope, STORE_FAILURES, by), v.line("{{tier}}"))],
        ((None, "green"), (ANY_FAILURE_PER_SECOND, "red")),
        v.drill_down,
        no_value=no_value_without_source(STORE_FAILURES.removeprefix("kvcache_")),
    )


def tier_blocks(v: View):
    by = ("tier",)
    return timeseries(
        "Offload tier blocks, by its events",
        describe(
            "Blocks each offload tier holds by its own stores and evictions (since the exporter joined the "
            "stream), over the whole selection, and per second: blocks it served (the GPU pool stored them while "
            "the tier held them: loaded, not computed), and its capacity misses (blocks stored to it again after "
            "it had evicted them: computed again on the GPU). " + TIER_STREAM_ONLY,
            "no red band. Capacity misses near the blocks served: the tier evicts what comes back; see What a "
            "larger offload tier would buy.",
        ),
        BLOCKS,
        [Query(promql.total(v.scope, TIER_RESIDENT, by), "{{tier}} resident"),
         Query(promql.rate(v.scope, SERVED, by), "{{tier}} served /s"),
         Query(promql.rate(v.scope, TIER_MISSES, by), "{{tier}} capacity misses /s")],
        bands.neutral(),
    )


def tier_what_if(v: View):
    by = ("tier",)
    served = promql.rate(v.scope, SERVED, by)
    queries = [Query(served, "{{tier}} today")]
    buckets = v.selector(TIER_DISTANCE + "_bucket")
    queries += [Query(f"{served} + {promql.summed(promql.kept_misses(factor, buckets, promql.RATE_INTERVAL), by)}",
                      f"{{{{tier}}}} x{factor:g}") for factor in WHAT_IF_FACTORS]
    return timeseries(
        "What a larger offload tier would buy",
        describe(
            "Blocks per second each offload tier served (offload hits, attributed to the tier that served them), "
            "and what a tier 1.25x, 1.5x, 2x and 4x as large would have served: today's plus its capacity misses "
            "that lay at most factor - 1 tier capacities below it (LRU, as the GPU pool's projection). "
            + TIER_STREAM_ONLY,
            "no red band. Where the x2 line is well above today's, more host memory for the tier pays: each "
            "block more served is a block of prefill not computed again.",
        ),
        BLOCKS + "/s",
        queries,
        bands.neutral(),
    )
