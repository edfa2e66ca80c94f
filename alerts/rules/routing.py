"""Routing loss (the fleet index, `fleet_index:`): prompt tokens a replica computed while another replica of the
same model held them, per model; the hit ratio the fleet had and the one a perfect prefix-affinity router would
have had; the alert on a model whose router sends repeats away from the replica holding them."""

from __future__ import annotations

from kvcache_exporter.alerts.rules.common import alert, number, with_traffic
from kvcache_exporter.thresholds import Thresholds
from kvcache_exporter.units import format_duration

PER_MODEL = "by (model)"  # the fleet index's series carry `model` alone


def recording_rules(t: Thresholds) -> list[dict]:
    w = format_duration(t.window_seconds)
    hits = f"sum {PER_MODEL} (rate(kvcache_prefix_cache_hit_tokens_total[{w}]))"
    queried = f"(sum {PER_MODEL} (rate(kvcache_prefix_cache_queried_tokens_total[{w}])) > 0)"
    return [
        {"record": "kvcache:routing_recomputed_tokens:rate",
         "expr": f"sum {PER_MODEL} (rate(kvcache_routing_recomputed_tokens_total[{w}]))"},
        {"record": "kvcache:fleet_stored_tokens:rate",
         "expr": f"sum {PER_MODEL} (rate(kvcache_fleet_stored_tokens_total[{w}]))"},
        {"record": "kvcache:routing_recomputed_share_of_prefill:ratio",
         "expr": "kvcache:routing_recomputed_tokens:rate\n/\n(kvcache:fleet_stored_tokens:rate > 0)"},
        {"record": "kvcache:fleet_prefix_cache_hit_ratio:rate", "expr": f"{hits}\n/\n{queried}"},
        # A perfect prefix-affinity router would have served the recomputed tokens from the sibling that held them.
        {"record": "kvcache:fleet_prefix_cache_hit_ratio:affinity",
         "expr": f"clamp_max(\n  ({hits} + kvcache:routing_recomputed_tokens:rate)\n  /\n  {queried},\n  1\n)"},
    ]


def routing_loss_alert(t: Thresholds, runbook_base: str) -> dict:
    w = format_duration(t.window_seconds)
    share = f"kvcache:routing_recomputed_share_of_prefill:ratio > {number(t.routing_loss_share)}"
    return alert(
        "KVCacheRoutingLoss", "info",
        with_traffic(share, "kvcache:fleet_stored_tokens:rate", t.traffic_floor_prefix_tokens_per_second),
        t.routing_loss_for,
        "model {{ $labels.model }}: prefix-aware routing would save prefill another replica had cached",
        f"Prefix-aware routing would save {{{{ $value | humanizePercentage }}}} of prefill: that share of the prompt tokens the replicas of model {{{{ $labels.model }}}} "
        f"computed over {w} were held at that moment by another replica of the model: the router sent the "
        "request away from the cache that had its prefix. kvcache:fleet_prefix_cache_hit_ratio:affinity says "
        "the hit ratio a prefix-affinity router would have had.",
        runbook_base,
    )
