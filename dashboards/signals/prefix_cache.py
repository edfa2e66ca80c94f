"""Prefix cache: the windowed hit ratio, the traffic behind it, and its drop against a baseline."""

from __future__ import annotations

from kvcache_exporter.dashboards import bands, promql
from kvcache_exporter.dashboards.panels import (Query, describe, no_value_without_source, stat, timeseries,
                                                without_source)
from kvcache_exporter.dashboards.view import PER_TARGET, RATIO, TOKENS, TOKENS_PER_SECOND, View, percent

HIT = "kvcache_prefix_cache_hit_tokens_total"

QUERIED = "kvcache_prefix_cache_queried_tokens_total"
MIN_HIT = "kvcache_prefix_cache_min_hit_tokens"
STREAM_BLOCK = "kvcache_events_block_size_tokens"


def hit_ratio_now(v: View):
    t = v.thresholds
    return stat(
        "Prefix-cache hit ratio now" if v.one_target else "Lowest prefix-cache hit ratio",
        describe(
            ("The target's windowed prefix-cache hit ratio, where it looks up at least " if v.one_target else
             "The lowest windowed prefix-cache hit ratio of any target that looks up at least ")
            + f"{t.traffic_floor_prefix_tokens_per_second:g} prompt tokens/s: sum(rate(hit tokens)) / "
            "sum(rate(queried tokens)) per target over the rate interval, never lifetime counters.",
            "this stat has no absolute red: a good ratio depends on the workload. Hit ratio vs baseline "
            "turns red when a target's ratio falls below its own baseline, the condition of "
            "KVCachePrefixHitRateDrop.",
        ),
        RATIO,
        [Query(promql.least(busy_hit_ratio(v, PER_TARGET)), "hit ratio")],
        bands.neutral(),
        min_max=(0, 1),
        no_value=f"No data: under {t.traffic_floor_prefix_tokens_per_second:g} prompt tokens/s looked up",
    )


def busy_hit_ratio(v: View, by: tuple[str, ...], offset: str = "") -> str:
    """The windowed hit ratio per `by` group, where it looks up at least the alert's traffic floor."""
    busy = promql.at_least(promql.rate(v.scope, QUERIED, by), v.thresholds.traffic_floor_prefix_tokens_per_second)
    return promql.only_where(promql.rate_ratio(v.scope, HIT, QUERIED, by, offset), busy, by)


def hit_ratio(v: View):
    return timeseries(
        f"Prefix-cache hit ratio {v.per}",
        describe(
            f"Windowed share of looked-up prompt tokens served from the prefix cache, {v.per}: "
            "sum(rate(hit)) / sum(rate(queried)); no value without lookups."
            + without_source(HIT.removeprefix("kvcache_")),
            "no absolute red (it depends on the workload); see Hit ratio vs baseline. A drop with KV usage high "
            "means live requests evict the cache.",
        ),
        RATIO,
        [Query(promql.rate_ratio(v.scope, HIT, QUERIED, v.split), v.line())],
        bands.neutral(),
        v.drill_down,
        min_max=(0, 1),
        worst_low=True,
        no_value=no_value_without_source(HIT.removeprefix("kvcache_")),
    )


def min_hit_tokens(v: View):
    by = v.split
    return timeseries(
        f"Shortest prefix that can hit {v.per}",
        describe(
            "Tokens a shared prefix needs before it can be a prefix-cache hit: hits land on whole blocks, so a "
            "prompt sharing fewer tokens with a cached one (plus the one token the engine computes) is a miss "
            "however hot the prefix. The engine's page where it says it (vLLM's hit alignment or a hybrid model's "
            "full-attention block, else the block size), else the block size its KV event stream names. Hybrid "
            "and sliding-window models make vLLM choose blocks of 1,920 to 4,096 tokens (docs/kv-events.md).",
            "no red band. A value of thousands beside a low hit ratio: the shared prefixes (system prompts, "
            "few-shot headers) are shorter than one block and can never hit; lengthen them past it, or set a "
            "finer prefix_match_unit where the model allows.",
        ),
        TOKENS,
        [Query(f"{promql.highest(v.scope, MIN_HIT, by)} or {promql.highest(v.scope, STREAM_BLOCK, by)}", v.line())],
        bands.neutral(),
        v.drill_down,
    )


def hit_vs_queried(v: View):
    return timeseries(
        "Prefix-cache hit vs queried tokens",
        describe(
            "Prompt tokens looked up in the prefix cache per second, and the part served from it, over the "
            "whole selection.",
            "no red band: it gives the hit ratio its weight. A ratio drop on tiny traffic here is noise.",
        ),
        TOKENS_PER_SECOND,
        [Query(promql.rate(v.scope, QUERIED), "queried"), Query(promql.rate(v.scope, HIT), "hit")],
        bands.neutral(),
    )


def hit_ratio_vs_baseline(v: View):
    t = v.thresholds
    offset = t.prefix_hit_baseline_offset
    before = promql.rate_ratio(v.scope, HIT, QUERIED, v.split, offset=offset)
    return timeseries(
        "Hit ratio vs baseline",
        describe(
            f"Prefix-cache hit ratio now as a fraction of the same ratio {offset} earlier, {v.per}, shown while "
            f"it looks up at least {t.traffic_floor_prefix_tokens_per_second:g} prompt tokens/s (the "
            "alert's traffic floor). Needs that much history.",
            f"below {percent(t.prefix_hit_drop_fraction)} the cache serves much less than it did "
            "(KVCachePrefixHitRateDrop): KV pressure evicting it, a prompt template or routing change, or a "
            "restart that emptied it. Compare with KV usage and Evictable tokens.",
        ),
        RATIO,
        [Query(promql.ratio(busy_hit_ratio(v, v.split), before), v.line())],
        bands.hit_ratio_vs_baseline(t),
        v.drill_down,
    )
