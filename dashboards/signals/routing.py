"""Routing loss across the replicas of a model: the share of prefill a replica computed while a sibling held it,
and the hit ratio the fleet had beside the one a perfect prefix-affinity router would have had. From the
exporter's fleet index (`fleet_index:`, docs/kv-events.md), one line per model."""

from __future__ import annotations

from kvcache_exporter.dashboards import bands, promql
from kvcache_exporter.dashboards.panels import Query, describe, timeseries
from kvcache_exporter.dashboards.view import RATIO, View, percent

RECOMPUTED = "kvcache_routing_recomputed_tokens_total"
STORED = "kvcache_fleet_stored_tokens_total"
HIT = "kvcache_prefix_cache_hit_tokens_total"
QUERIED = "kvcache_prefix_cache_queried_tokens_total"
PER_MODEL = ("model",)
INDEX_ONLY = ("Present only where the exporter's fleet index is on (`fleet_index: {enabled: true}`) and the "
              "replicas' KV event streams are read (docs/kv-events.md, \"Routing loss across replicas\").")


def loss_share(v: View):
    t = v.thresholds
    return timeseries(
        "Routing loss: share of prefill a sibling held, per model",
        describe(
            "Prompt tokens a replica computed while another replica of the same model held the same blocks, as a "
            "share of the prompt tokens the model's replicas computed and stored. " + INDEX_ONLY,
            f"above {percent(t.routing_loss_share)} (KVCacheRoutingLoss) the router sends repeats away from the "
            "replica that holds their prefix: prefix-aware routing would save that share of prefill.",
        ),
        RATIO,
        [Query(promql.rate_ratio(v.scope, RECOMPUTED, STORED, PER_MODEL), "{{model}}")],
        ((None, "green"), (t.routing_loss_share, "red")),
        min_max=(0, 1),
    )


def hit_ratio_with_affinity(v: View):
    hits, queried = promql.rate(v.scope, HIT, PER_MODEL), promql.rate(v.scope, QUERIED, PER_MODEL)
    affinity = promql.at_most_one(promql.ratio(f"({hits} + {promql.rate(v.scope, RECOMPUTED, PER_MODEL)})", queried))
    return timeseries(
        "Prefix-cache hit ratio: the fleet's and with perfect affinity, per model",
        describe(
            "The prefix-cache hit ratio over each model's replicas, and what it would have been had every request "
            "gone to a replica holding its prefix (the hits plus the tokens recomputed while a sibling held them; "
            "bounded by what the siblings did hold, so by their capacity). " + INDEX_ONLY,
            "no red band. A wide gap between the two lines is a routing loss; two low lines close together are a "
            "workload that does not repeat.",
        ),
        RATIO,
        [Query(promql.ratio(hits, queried), "{{model}} today"),
         Query(affinity, "{{model}} perfect affinity")],
        bands.neutral(),
        min_max=(0, 1),
    )
