"""KV cache / target: one target in detail, one line per data-parallel rank."""

from __future__ import annotations

from grafana_foundation_sdk.models import dashboard as models

from kvcache_exporter.thresholds import Thresholds

from kvcache_exporter.dashboards import variables
from kvcache_exporter.dashboards.layout import Row, assemble
from kvcache_exporter.dashboards.panels import DATASOURCE_VARIABLE, Link
from kvcache_exporter.dashboards.promql import Scope
from kvcache_exporter.dashboards.rows import cache_rows
from kvcache_exporter.dashboards.signals import (disaggregated, exporter_health, kv, latency, memory, prefix_cache,
                                                 pressure)
from kvcache_exporter.dashboards.view import View

UID = "kvcache-target"
TITLE = "KV cache / target"
FILENAME = "kvcache-target.json"


def drill_down_link(static_labels: tuple[str, ...]) -> Link:
    """A data link that opens this dashboard on the series' target, keeping data source, filters and time."""
    params = [f"${{{name}:queryparam}}"
              for name in (DATASOURCE_VARIABLE, *variables.filtered(*static_labels, variables.NAMESPACE))]
    params += ["var-target=${__field.labels.target}", "${__url_time_range}"]
    return Link("Open ${__field.labels.target} in " + TITLE, f"/d/{UID}/kvcache-target?{'&'.join(params)}")


def build(thresholds: Thresholds, static_labels: tuple[str, ...], pd_group_label: str = "") -> models.Dashboard:
    """(One target has no P/D group: `pd_group_label` is the fleet's.)"""
    labels = variables.filtered(*static_labels, variables.NAMESPACE, "target")
    v = View(Scope(labels), split=("target", "dp_rank"), per="per rank", legend="{{target}} dp{{dp_rank}}",
             thresholds=thresholds, latency_quantiles=(0.5, 0.9, 0.99))
    rows = [
        # Four stats a line at most, as on the fleet dashboard. The state first and half the width: its reason's
        # words are the longest value on the page (a quarter drew them in a 6 px font), beside the queue they quote.
        Row("Overview", ((pressure.state_now(v), pressure.waiting_now(v)),
                         (exporter_health.targets_up(v), kv.usage_now(v), kv.headroom_now(v),
                          pressure.preemptions_per_minute(v)),
                         (prefix_cache.hit_ratio_now(v), memory.bytes_per_token(v)))),
        Row("KV", ((kv.usage(v), kv.headroom(v), kv.time_until_full(v)),
                   (kv.free_tokens(v), kv.free_blocks(v), kv.live_tokens_per_request(v), kv.capacity(v)))),
        Row("Pressure", ((pressure.states_over_time(v), pressure.running(v)),
                         (pressure.waiting(v), pressure.preemption_rate(v)))),
        *cache_rows(v),
        Row("Latency", ((latency.ttft(v), latency.itl(v), latency.queue_time(v)),
                        (latency.ttft_heatmap(v), latency.queue_time_heatmap(v), latency.queue_share_of_ttft(v)))),
        Row("KV memory", ((memory.kv_bytes(v),),)),
        # The target's own side of P/D (its peers are on other targets: backpressure is the fleet's).
        Row("Disaggregated prefill/decode", ((disaggregated.transfer_stages(v), disaggregated.held_for_export(v),
                                              disaggregated.transfer_time(v)),
                                             (disaggregated.bandwidth(v), disaggregated.failures_and_expiries(v)))),
        Row("Exporter health", ((exporter_health.target_up_over_time(v), exporter_health.poll_duration(v),
                                 exporter_health.poll_failures(v), exporter_health.since_last_good_poll(v)),)),
    ]
    return assemble(
        UID, TITLE,
        "One target's KV cache in detail: each data-parallel rank's pool, latency distributions, KV memory "
        "and the exporter's polls of it. Reached from KV cache / fleet.",
        variables.label_filters(labels, single=frozenset({"target"})), rows,
        alerts_of=("target",),
    )
