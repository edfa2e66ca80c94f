"""KV pool: how full, how much is free, what holds it, how big it is."""

from __future__ import annotations

from exporter.thresholds import Thresholds

from dashboards import bands, promql
from dashboards.panels import Query, describe, stat, timeseries
from dashboards.view import BLOCKS, RATIO, TOKENS, View, percent

USAGE_SHOWS = (
    "KV pool fill: tokens held by live requests divided by pool capacity, summed over pools before "
    "dividing (never an average of per-pool ratios). Evictable prefix-cache blocks count as free."
)


def usage_red(t: Thresholds) -> str:
    return (
        f"at or above {percent(t.high_water_ratio)} (amber from {percent(t.low_water_ratio)}) the pool is "
        "nearly full: new requests soon queue for KV. Check Waiting for capacity and Preemptions; add "
        "replicas, lower max sequence length or concurrency, or move traffic to a target with room."
    )


def usage_now(v: View):
    t = v.thresholds
    return stat(
        "KV usage",
        describe(USAGE_SHOWS, usage_red(t)),
        RATIO,
        [Query(promql.gauge_ratio(v.scope, "kvcache_used_tokens", "kvcache_capacity_tokens"), "usage")],
        bands.usage(t),
        min_max=(0, 1),
    )


def free_tokens_now(v: View):
    return stat(
        "Free KV tokens",
        describe(
            "Tokens a new request could get without preempting anyone (unallocated plus evictable prefix cache), "
            "summed over the selection.",
            "this count has no red band of its own; KV usage turns red when free tokens run short. A free count "
            "below one typical request's length (see Live tokens per request) means the next request queues.",
        ),
        TOKENS,
        [Query(promql.total(v.scope, "kvcache_free_tokens"), "free")],
        bands.neutral(),
    )


def usage(v: View):
    t = v.thresholds
    return timeseries(
        f"KV usage {v.per}",
        describe(f"{USAGE_SHOWS} One line {v.per}; the lines mark the amber and red bands.", usage_red(t)),
        RATIO,
        [Query(promql.gauge_ratio(v.scope, "kvcache_used_tokens", "kvcache_capacity_tokens", v.split), v.line())],
        bands.usage(t),
        v.drill_down,
        min_max=(0, 1),
    )


def free_tokens(v: View):
    return timeseries(
        f"Free KV tokens {v.per}",
        describe(
            f"Tokens a new request could get without preempting anyone, {v.per}; evictable prefix-cache tokens "
            "count as free.",
            "no red band here; KV usage carries it. A line near zero while requests wait is a pool out of KV.",
        ),
        TOKENS,
        [Query(promql.total(v.scope, "kvcache_free_tokens", v.split), v.line())],
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


def evictable_tokens(v: View):
    return timeseries(
        "Evictable prefix-cache tokens",
        describe(
            "Free tokens that still hold reusable prefix-cache content (SGLang only; vLLM does not report it). "
            "They count as free: the engine evicts them when a request needs the room.",
            "no red band: many evictable tokens are good (cache kept for reuse). If it falls to zero while usage "
            "is high, live requests have pushed the cache out and the hit ratio will drop.",
        ),
        TOKENS,
        [Query(promql.total(v.scope, "kvcache_evictable_tokens", v.split), v.line())],
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
