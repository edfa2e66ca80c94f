"""Rows both dashboards show alike: where prefix hits come from, the offload tiers, what more KV would buy."""

from __future__ import annotations

from kvcache_exporter.dashboards.layout import Row
from kvcache_exporter.dashboards.signals import offload, prefix_cache, what_if
from kvcache_exporter.dashboards.view import View


def cache_rows(v: View) -> list[Row]:
    return [
        Row("Prefix cache", ((prefix_cache.hit_ratio(v), prefix_cache.min_hit_tokens(v), prefix_cache.hit_vs_queried(v),
                              prefix_cache.hit_ratio_vs_baseline(v), offload.hit_ratio_by_source(v)),)),
        Row("Offload tiers", ((offload.tier_usage(v), offload.tier_tokens(v), offload.store_failures(v)),
                              (offload.transfer_bytes(v), offload.transfer_tokens(v),
                               offload.load_seconds_per_token(v)),
                              (offload.tier_blocks(v), offload.tier_what_if(v)))),
        Row("What more KV would buy", ((what_if.capacity_miss_share(v), what_if.projected_hit_ratio(v),
                                         what_if.residency(v)), (what_if.who_holds(v), what_if.who_loses(v)))),
    ]
