"""Prefix cache: the prompt tokens looked up, the hit ratio over the window and a baseline of it some time earlier,
and the alert on a hit ratio that dropped below that baseline."""

from __future__ import annotations

from kvcache_exporter.alerts.rules.common import WHERE, alert, number, target_rate, with_traffic
from kvcache_exporter.thresholds import Thresholds
from kvcache_exporter.units import format_duration


def recording_rules(t: Thresholds) -> list[dict]:
    w = format_duration(t.window_seconds)

    def hit_ratio(offset: str = "") -> str:
        return (
            f"{target_rate('kvcache_prefix_cache_hit_tokens_total', w, offset)}\n"
            f"/\n({target_rate('kvcache_prefix_cache_queried_tokens_total', w, offset)} > 0)"
        )

    return [
        {"record": "kvcache:prefix_cache_queried_tokens:rate",
         "expr": target_rate("kvcache_prefix_cache_queried_tokens_total", w)},
        # Hit ratio of rates over a window, never of the lifetime counters.
        {"record": "kvcache:prefix_cache_hit_ratio:rate", "expr": hit_ratio()},
        {"record": "kvcache:prefix_cache_hit_ratio:baseline",
         "expr": hit_ratio(f" offset {t.prefix_hit_baseline_offset}")},
    ]


def hit_rate_drop_alert(t: Thresholds, runbook_base: str) -> dict:
    return alert(
        "KVCachePrefixHitRateDrop", "warning",
        with_traffic(f"kvcache:prefix_cache_hit_ratio:rate < {number(t.prefix_hit_drop_fraction)} "
                     "* kvcache:prefix_cache_hit_ratio:baseline",
                     "kvcache:prefix_cache_queried_tokens:rate", t.traffic_floor_prefix_tokens_per_second),
        t.prefix_hit_drop_for,
        f"{WHERE}: the prefix-cache hit ratio dropped",
        f"Prefix-cache hit ratio {{{{ $value | humanizePercentage }}}} over {format_duration(t.window_seconds)} on "
        f"{WHERE}, below {number(t.prefix_hit_drop_fraction * 100)}% of its ratio {t.prefix_hit_baseline_offset} "
        "earlier. Every miss is prefill recomputed and KV spent twice.",
        runbook_base,
    )
