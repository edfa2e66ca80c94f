"""What more KV would buy: capacity misses (blocks evicted for room and computed again) as prompt tokens, per pool
size factor the tokens a larger pool would have kept and the hit ratio it had, and the alert on a pool whose
prompts are computed again for want of room."""

from __future__ import annotations

from kvcache_exporter.alerts.rules.common import PER_TARGET, WHERE, alert, number, with_traffic
from kvcache_exporter.contract import WHAT_IF_FACTORS
from kvcache_exporter.dashboards.promql import kept_misses
from kvcache_exporter.thresholds import Thresholds
from kvcache_exporter.units import format_duration


def kept_tokens(factor: float, window: str) -> str:
    """Prompt tokens per second a pool `factor` times as large would have served from cache: the capacity
    misses it keeps (the dashboards' promql.kept_misses, as the panels count them) times the block size.

    The panels' what_if.kept_tokens multiplies the same two terms, but sums `by` the dashboard's split over
    selectors with its variables, on one line; the rule sums `without (dp_rank, le)`, laid out over lines: one
    function for both would change one of the two texts."""
    within = kept_misses(factor, "kvcache_capacity_miss_distance_ratio_bucket", window)
    return f"sum without (dp_rank, le) (\n  (\n    {within}\n  )\n  * ignoring (le) kvcache_block_size_tokens\n)"


def recording_rules(t: Thresholds) -> list[dict]:
    w = format_duration(t.window_seconds)
    rules = [
        {"record": "kvcache:capacity_miss_tokens:rate", "expr": (
            f"sum {PER_TARGET} (\n  rate(kvcache_capacity_miss_blocks_total[{w}]) * kvcache_block_size_tokens\n)")},
        {"record": "kvcache:capacity_miss_share_of_queried:ratio", "expr": (
            "kvcache:capacity_miss_tokens:rate\n/\n(kvcache:prefix_cache_queried_tokens:rate > 0)")},
    ]
    for factor in WHAT_IF_FACTORS:
        label = {"factor": number(factor)}
        rules.append({"record": "kvcache:capacity_miss_tokens_kept:rate", "labels": label,
                      "expr": kept_tokens(factor, w)})
        rules.append({"record": "kvcache:prefix_cache_hit_ratio:projected", "labels": dict(label), "expr": (
            f"clamp_max(\n"
            f"  (\n    sum {PER_TARGET} (rate(kvcache_prefix_cache_hit_tokens_total[{w}]))\n"
            f"    + ignoring (factor) kvcache:capacity_miss_tokens_kept:rate{{factor=\"{number(factor)}\"}}\n  )\n"
            f"  /\n  (kvcache:prefix_cache_queried_tokens:rate > 0),\n  1\n)")})
    return rules


def capacity_misses_alert(t: Thresholds, runbook_base: str) -> dict:
    w = format_duration(t.window_seconds)
    share = f"kvcache:capacity_miss_share_of_queried:ratio > {number(t.capacity_miss_share)}"
    return alert(
        "KVCacheCapacityMisses", "info",
        with_traffic(share, "kvcache:prefix_cache_queried_tokens:rate", t.traffic_floor_prefix_tokens_per_second),
        t.capacity_miss_for,
        f"{WHERE}: prompts are computed again because the KV pool evicted them",
        f"{{{{ $value | humanizePercentage }}}} of the prompt tokens looked up on {WHERE} over {w} had been "
        "cached, were evicted for room and were computed again. kvcache:prefix_cache_hit_ratio:projected "
        "says what a larger pool would have served from cache.",
        runbook_base,
    )
