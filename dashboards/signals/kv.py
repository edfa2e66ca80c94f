"""KV pool: how full, how much is free, what holds it, how big it is."""

from __future__ import annotations

from kvcache_exporter.thresholds import Thresholds

from kvcache_exporter.dashboards import bands, promql
from kvcache_exporter.dashboards.panels import Query, describe, stat, timeseries
from kvcache_exporter.dashboards.view import BLOCKS, HEADROOM_UNIT, PER_TARGET, POOL, RATIO, SECONDS, TARGETS, TOKENS, View, percent

USAGE_SHOWS = (
    "KV pool fill as the engine reports it (evictable prefix-cache blocks count as free), of the fullest "
    "pool: a target with several data-parallel ranks is as full as its fullest rank, since that rank "
    "queues its own requests."
)

HEADROOM = "kvcache_headroom_requests"

HEADROOM_SHOWS = (
    "Headroom: free KV tokens divided by the live tokens of one running request, i.e. how many more "
    "requests of today's typical size fit in the pool. No value while nothing runs."
)


def usage_red(t: Thresholds) -> str:
    return (
        f"at or above {percent(t.high_water_ratio)} (amber from {percent(t.low_water_ratio)}) the pool is "
        "nearly full: new requests soon queue for KV. Check Waiting for KV and Preemptions; add "
        "replicas, lower max sequence length or concurrency, or move traffic to a target with room."
    )


def headroom_red() -> str:
    return (
        "below 1 the next typical request does not fit: it waits for KV, or the engine preempts to admit it. "
        "Move traffic to a pool with headroom, add replicas, or lower max sequence length."
    )


def usage_now(v: View):
    t = v.thresholds
    return stat(
        "Fullest pool's KV usage",
        describe(USAGE_SHOWS + " Named by its target and rank.", usage_red(t)),
        RATIO,
        [Query(f"topk(1, {promql.highest(v.scope, 'kvcache_usage_ratio', POOL)})", "{{target}} rank {{dp_rank}}")],
        bands.usage(t),
        min_max=(0, 1),
        named=True,
        links=v.drill_down,
    )


def pools_without_room(v: View):
    return stat(
        "Pools without room for one more request",
        describe(
            "Targets whose least-free rank has a headroom below 1: not even one more request of the current "
            f"typical size fits. {HEADROOM_SHOWS}",
            headroom_red(),
        ),
        TARGETS,
        [Query(promql.count_where(f"{promql.least(v.selector(HEADROOM), PER_TARGET)} < 1"), "pools")],
        bands.any_present(),
    )


def headroom_now(v: View):
    return stat(
        "Headroom",
        describe(f"{HEADROOM_SHOWS} The rank with the least headroom.", headroom_red()),
        HEADROOM_UNIT,
        [Query(promql.least(v.selector(HEADROOM)), "requests")],
        bands.headroom(),
        no_value="No data: nothing runs, no typical request to size by",
    )


def headroom(v: View):
    return timeseries(
        f"Headroom {v.per}",
        describe(f"{HEADROOM_SHOWS} One line {v.per}, its least-free pool; the red line marks 1.", headroom_red()),
        HEADROOM_UNIT,
        [Query(promql.least(v.selector(HEADROOM), v.split), v.line())],
        bands.headroom(),
        v.drill_down,
        worst_low=True,
    )


def time_until_full(v: View):
    t = v.thresholds
    fill_rate = f"deriv({v.selector('kvcache_used_tokens')}[{promql.RATE_INTERVAL}])"
    until_full = f"{v.selector('kvcache_free_tokens')} / ({fill_rate} > 0)"
    filling = promql.at_least(v.selector("kvcache_usage_ratio"), t.low_water_ratio)
    return timeseries(
        f"Time until full {v.per}",
        describe(
            "Free KV tokens divided by the rate at which used tokens grew over the rate interval: when the pool "
            f"is full if it keeps filling this fast. Shown for pools at or above {percent(t.low_water_ratio)} "
            f"usage and filling; one line {v.per}, its soonest-full pool.",
            f"below {t.nearly_full_horizon_seconds / 60:g} min the pool fills within KVCacheNearlyFull's horizon: "
            "requests will soon wait for KV. Shed or move load before it does.",
        ),
        SECONDS,
        [Query(promql.least(promql.only_where(until_full, filling, POOL), v.split), v.line())],
        bands.sooner_than(t.nearly_full_horizon_seconds),
        v.drill_down,
        worst_low=True,
    )


def usage(v: View):
    t = v.thresholds
    return timeseries(
        f"KV usage {v.per}",
        describe(f"{USAGE_SHOWS} One line {v.per}; the lines mark the amber and red bands.", usage_red(t)),
        RATIO,
        [Query(promql.highest(v.scope, "kvcache_usage_ratio", v.split), v.line())],
        bands.usage(t),
        v.drill_down,
        min_max=(0, 1),
    )


def free_tokens(v: View):
    return timeseries(
        f"Free KV tokens {v.per}",
        describe(
            f"Tokens a new request could get without preempting anyone, {v.per}. Where the engine reports it "
            "(SGLang), the evictable part: free tokens that still hold reusable prefix-cache content, which the "
            "engine evicts when a request needs the room.",
            "no red band here; Headroom carries it. A line near zero while requests wait is a pool out of KV; "
            "evictable tokens falling to zero while usage is high means live requests push the cache out.",
        ),
        TOKENS,
        [Query(promql.total(v.scope, "kvcache_free_tokens", v.split), v.line()),
         Query(promql.total(v.scope, "kvcache_evictable_tokens", v.split), v.line("evictable"))],
        bands.neutral(),
        v.drill_down,
    )


def free_blocks(v: View):
    return timeseries(
        f"Free KV blocks {v.per}",
        describe(
            f"Free KV blocks (pages) {v.per}: the unit the engine allocates in. Blocks x block size = tokens.",
            "no red band here; KV usage carries it. The engine hands out whole blocks, so each sequence can "
            "leave up to one block's worth of tokens unused: many short sequences need more blocks than tokens "
            "suggest.",
        ),
        BLOCKS,
        [Query(promql.total(v.scope, "kvcache_free_blocks", v.split), v.line())],
        bands.neutral(),
        v.drill_down,
    )


def live_tokens_per_request(v: View):
    return timeseries(
        "Live tokens per request",
        describe(
            "KV tokens held per running request (used tokens / running requests, each summed first): the live "
            "sequence length the pool is spent on. No value while nothing runs.",
            "no red band. A rise here with flat traffic means longer prompts or outputs, which fill KV with fewer "
            "requests; compare with KV usage and consider a max sequence length.",
        ),
        TOKENS,
        [Query(promql.ratio(promql.total(v.scope, "kvcache_used_tokens", v.split),
                            promql.total(v.scope, "kvcache_requests_running", v.split)), v.line())],
        bands.neutral(),
        v.drill_down,
    )


def capacity(v: View):
    return timeseries(
        f"KV capacity {v.per}",
        describe(
            f"KV pool capacity in tokens {v.per}, as the engine sized it at start-up.",
            "no red band. A step down means the engine restarted with less KV memory (gpu_memory_utilization, "
            "TP size, model or dtype changed); a pool that differs from its peers is misconfigured.",
        ),
        TOKENS,
        [Query(promql.total(v.scope, "kvcache_capacity_tokens", v.split), v.line())],
        bands.neutral(),
        v.drill_down,
    )
