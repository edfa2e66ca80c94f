"""What more KV would buy: capacity misses (prompt blocks evicted for room and computed again), the hit
ratio a larger pool would have had, and how long blocks stay. From the targets' KV event streams
(`kv_events:`, docs/kv-events.md); empty for targets without one."""

from __future__ import annotations

from kvcache_exporter.contract import WHAT_IF_FACTORS
from kvcache_exporter.dashboards import bands, promql
from kvcache_exporter.dashboards.panels import Query, describe, timeseries
from kvcache_exporter.dashboards.view import BLOCKS, RATIO, SECONDS, View, percent

MISSES = "kvcache_capacity_miss_blocks_total"
DISTANCE = "kvcache_capacity_miss_distance_ratio"
RESIDENCY = "kvcache_block_residency_seconds"
BLOCK_SIZE = "kvcache_block_size_tokens"
HIT = "kvcache_prefix_cache_hit_tokens_total"
QUERIED = "kvcache_prefix_cache_queried_tokens_total"
STREAM_ONLY = ("Present only for targets whose KV event stream the exporter reads (`kv_events:` in its "
               "configuration, docs/kv-events.md).")
HOLDERS = ("Per adapter (LoRA, `base` without one) and per tenant (a keyed hash of the request's cache salt, "
           "`none` without one; labels change when the exporter restarts); each pool shows its top "
           "kv_events.top_holders and sums the rest as `other` (docs/kv-events.md).")
FACTORS = ("A pool twice as large is what an fp8 KV cache gives on the same GPUs (x2 tokens per byte, "
           "docs/kv-math.md); 1.25x and 1.5x a larger GPU memory share or offload, 4x more tensor-parallel "
           "ranks or GPUs with more memory.")


def miss_tokens(v: View, by: tuple[str, ...]) -> str:
    """Prompt tokens per second computed again after an eviction: capacity-miss blocks x block size."""
    return promql.summed(f"{promql.windowed(v.scope, MISSES)} * {v.selector(BLOCK_SIZE)}", by)


def kept_tokens(v: View, factor: float, by: tuple[str, ...]) -> str:
    """Prompt tokens per second a pool `factor` times as large would have served: the capacity misses it
    keeps (promql.kept_misses) times the block size."""
    kept = promql.kept_misses(factor, v.selector(DISTANCE + "_bucket"), promql.RATE_INTERVAL)
    return promql.summed(f"({kept}) * ignoring (le) {v.selector(BLOCK_SIZE)}", by)


def capacity_miss_share(v: View):
    t = v.thresholds
    return timeseries(
        f"Capacity misses, share of prompt tokens {v.per}",
        describe(
            "Prompt tokens computed again because their blocks had been cached and were evicted to make room "
            f"(capacity-miss blocks x block size), as a share of the prompt tokens looked up, {v.per}. "
            + STREAM_ONLY,
            f"above {percent(t.capacity_miss_share)} (KVCacheCapacityMisses) the pool is too small for the "
            "prompts' working set: see the projected hit ratio for what a larger one would buy.",
        ),
        RATIO,
        [Query(promql.ratio(miss_tokens(v, v.split), promql.rate(v.scope, QUERIED, v.split)), v.line())],
        ((None, "green"), (t.capacity_miss_share, "red")),
        v.drill_down,
        min_max=(0, 1),
    )


def projected_hit_ratio(v: View):
    now = promql.rate(v.scope, HIT)
    queried = promql.rate(v.scope, QUERIED)
    queries = [Query(promql.rate_ratio(v.scope, HIT, QUERIED), "today's pool")]
    queries += [Query(promql.at_most_one(promql.ratio(f"({now} + {kept_tokens(v, factor, ())})", queried)),
                      f"x{factor:g}") for factor in WHAT_IF_FACTORS]
    return timeseries(
        "Projected prefix-cache hit ratio by pool size",
        describe(
            "The prefix-cache hit ratio over the selection today, and what it would have been with a KV pool "
            "1.25x, 1.5x, 2x and 4x as large: today's hits plus the capacity misses a pool that much larger "
            "would have kept (under LRU, those whose blocks lay at most factor - 1 pool capacities below it). "
            + FACTORS + " " + STREAM_ONLY,
            "no red band. Where the x2 line is well above today's, more KV per replica pays; where even x4 "
            "stays close, the misses are not for lack of KV.",
        ),
        RATIO,
        queries,
        bands.neutral(),
        min_max=(0, 1),
    )


def residency(v: View):
    by = v.split
    return timeseries(
        f"Block residency {v.per}",
        describe(
            "How long a cached block stays in the pool, from its store to its eviction (p50 and p90 over the "
            "rate interval, by the engine's own timestamps). vLLM evicts a block when it reuses its memory, so "
            "this is cached-until-needed, not in-use time. " + STREAM_ONLY,
            "no red band. Short residency with capacity misses: prefixes come back later than the pool keeps "
            "them.",
        ),
        SECONDS,
        [Query(promql.quantile(q, v.scope, RESIDENCY, by), v.line(f"p{q * 100:g}")) for q in (0.5, 0.9)],
        bands.neutral(),
        v.drill_down,
    )


def who_holds(v: View):
    by_holder = [Query(promql.total(v.scope, f"kvcache_{holder}_blocks_resident", (holder,)),
                       f"{holder} {{{{{holder}}}}}") for holder in ("adapter", "tenant")]
    return timeseries(
        "Who holds the KV",
        describe("Blocks resident in the GPU pools of the selection, by adapter and by tenant. " + HOLDERS + " "
                 + STREAM_ONLY,
                 "no red band. One tenant or adapter holding most of the pool while others' capacity misses "
                 "grow (next panel) is one workload evicting the others' prefixes."),
        BLOCKS, by_holder, bands.neutral())


def who_loses(v: View):
    by_holder = [Query(promql.rate(v.scope, f"kvcache_{holder}_capacity_miss_blocks_total", (holder,)),
                       f"{holder} {{{{{holder}}}}}") for holder in ("adapter", "tenant")]
    return timeseries(
        "Who loses the KV: capacity misses by holder",
        describe("Blocks per second stored again after an eviction for room, by the adapter and the tenant "
                 "whose blocks they are. " + HOLDERS + " " + STREAM_ONLY,
                 "no red band. Misses concentrated on the holders with little residency: they lose the pool "
                 "to the ones that hold it (previous panel)."),
        BLOCKS + "/s", by_holder, bands.neutral())
