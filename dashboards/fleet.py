"""KV cache / fleet: every target at once, one line per target; a click on a line opens it."""

from __future__ import annotations

from grafana_foundation_sdk.models import dashboard as models

from kvcache_exporter.config import DEFAULT_PD_GROUP_LABEL
from kvcache_exporter.thresholds import Thresholds

from kvcache_exporter.dashboards import target, variables
from kvcache_exporter.dashboards.layout import Row, assemble
from kvcache_exporter.dashboards.promql import Scope
from kvcache_exporter.dashboards.rows import cache_rows
from kvcache_exporter.dashboards.signals import (disaggregated, exporter_health, kv, latency, prefix_cache, pressure,
                                                 routing, triage)
from kvcache_exporter.dashboards.view import View

UID = "kvcache-fleet"
TITLE = "KV cache / fleet"
FILENAME = "kvcache-fleet.json"


def build(thresholds: Thresholds, static_labels: tuple[str, ...],
          pd_group_label: str = DEFAULT_PD_GROUP_LABEL) -> models.Dashboard:
    labels = variables.filtered(*static_labels, variables.NAMESPACE, "engine", "model", variables.POD, "target")
    # One p90 line per target: a fleet of 200 targets stays a readable graph, and no quantile adds
    # up two engines' unlike buckets.
    v = View(Scope(labels), split=("target",), per="per target", legend="{{target}}", thresholds=thresholds,
             latency_quantiles=(0.9,), drill_down=(target.drill_down_link(static_labels),), pd_group=pd_group_label)
    rows = [
        # Four stats a line at most: narrower, Grafana cuts their titles short ("Most pree...").
        Row("Overview", ((exporter_health.targets_up(v), kv.usage_now(v), kv.pools_without_room(v),
                          pressure.targets_per_state(v)),
                         (pressure.preemptions_per_minute(v), prefix_cache.hit_ratio_now(v), pressure.waiting_now(v)),
                         (triage.pools_needing_help(v),))),
        Row("KV", ((kv.usage(v), kv.headroom(v), kv.time_until_full(v)),
                   (kv.free_tokens(v), kv.live_tokens_per_request(v), kv.capacity(v)))),
        Row("Pressure", ((pressure.states_over_time(v), pressure.waiting(v)),
                         (pressure.running(v), pressure.preemption_rate(v), pressure.preempted_share(v)))),
        *cache_rows(v),
        Row("Routing across replicas", ((routing.loss_share(v), routing.hit_ratio_with_affinity(v)),)),
        Row("Latency", ((latency.ttft(v), latency.itl(v), latency.queue_time(v)), (latency.queue_share_of_ttft(v),))),
        Row("Disaggregated prefill/decode", ((disaggregated.usage_by_role(v), disaggregated.held_for_export(v),
                                              disaggregated.transfer_stages(v), disaggregated.backpressure(v)),
                                             (disaggregated.transfer_time(v), disaggregated.bandwidth(v),
                                              disaggregated.failures_and_expiries(v)))),
        Row("Exporter health", ((exporter_health.target_up_over_time(v), exporter_health.poll_duration(v),
                                 exporter_health.poll_failures(v)),)),
    ]
    return assemble(
        UID, TITLE,
        "KV-cache capacity, pressure, prefix cache and latency of every engine the exporter polls. "
        "Click a target's line to open KV cache / target.",
        variables.label_filters(labels), rows, alerts_of=("target",),
    )
