"""Offload tiers, per tier: stores refused for want of room and seconds to load one token back, and the alerts on
a tier full while requests queue for KV and on loads slower than recomputing."""

from __future__ import annotations

from kvcache_exporter.alerts.rules.common import PER_TARGET, VALUE_PER_SECOND, WHERE, alert, number, target_rate, with_traffic
from kvcache_exporter.thresholds import Thresholds
from kvcache_exporter.units import format_duration

# Loads from an offload tier back to the GPU pool, by what they count.
LOAD = 'kvcache_tier_transfer_{}_total{{direction="load"}}'


def recording_rules(t: Thresholds) -> list[dict]:
    # SGLang counts tokens loaded; vLLM counts bytes, turned into tokens where the target's architecture gives
    # bytes per token.
    w = format_duration(t.window_seconds)
    return [
        {"record": "kvcache:tier_store_failures:rate", "expr": target_rate("kvcache_tier_store_failures_total", w)},
        {"record": "kvcache:tier_load_seconds_per_token:ratio", "expr": (
            f"{target_rate(LOAD.format('seconds'), w)}\n/\n(\n  (\n    {target_rate(LOAD.format('tokens'), w)}\n"
            f"    or\n    sum {PER_TARGET} (\n      rate({LOAD.format('bytes')}[{w}])\n"
            f"      / ignoring (tier, direction) group_left kvcache_bytes_per_token\n    )\n  ) > 0\n)"
        )},
    ]


def alerting_rules(t: Thresholds, runbook_base: str) -> list[dict]:
    w = format_duration(t.window_seconds)
    return [
        alert(
            "KVCacheOffloadTierFull", "warning",
            "kvcache:tier_store_failures:rate > 0\n"
            "and ignoring (tier) kvcache:requests_waiting_for_kv:sum > 0",
            t.offload_full_for,
            f"{WHERE}: the {{{{ $labels.tier }}}} offload tier is full while requests queue for KV",
            f"The {{{{ $labels.tier }}}} tier of {WHERE} refuses {VALUE_PER_SECOND} stores/s over {w}: it is full "
            "of KV it cannot evict, while requests wait for the GPU pool. "
            "Offloading no longer takes load off the GPU pool: what the tier cannot keep is recomputed.",
            runbook_base,
        ),
        alert(
            "KVCacheOffloadLoadSlow", "warning",
            with_traffic(f"kvcache:tier_load_seconds_per_token:ratio > {number(t.offload_load_max_seconds_per_token)}",
                         "ignoring (tier, direction) kvcache:requests_finished:rate", t.traffic_floor_requests_per_second),
            t.offload_slow_for,
            f"{WHERE}: loading KV back from the {{{{ $labels.tier }}}} tier costs more than recomputing it",
            f"Loading one token back from the {{{{ $labels.tier }}}} tier takes {{{{ $value | printf \"%.3g\" }}}} s "
            f"on {WHERE} over {w}, above {number(t.offload_load_max_seconds_per_token)} s, about what computing "
            "its prefill again costs: offload hits now slow prefill down instead of saving it.",
            runbook_base,
        ),
    ]
