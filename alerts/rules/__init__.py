"""The rules for the kvcache_* contract, one module per signal (as the dashboards' panels, dashboards/signals/):
each holds its signal's recording rules and the alerts that read them. `build` puts them in one group.

Every number in the rules comes from `Thresholds`; the P/D and fleet rules group pools by the configuration's
`pd_group_label`."""

from __future__ import annotations

from kvcache_exporter import config as exporter_config
from kvcache_exporter.alerts.rules import (
    disaggregated,
    exporter_health,
    fleet,
    latency,
    offload,
    prefix_cache,
    pressure,
    routing,
    what_if,
)
from kvcache_exporter.thresholds import DEFAULT, Thresholds

RUNBOOK_URL_BASE = "https://github.com/kvcache-exporter/kvcache-exporter/blob/main/alerts/runbook.md"


def build(thresholds: Thresholds = DEFAULT, runbook_base: str = RUNBOOK_URL_BASE,
          pd_group_label: str = exporter_config.DEFAULT_PD_GROUP_LABEL) -> dict:
    # One group: Prometheus evaluates a group's rules in order, so every alert reads recording
    # rules of the same evaluation; separate groups run concurrently and lag by one interval.
    return {"groups": [{"name": "kvcache", "rules": (
        recording_rules(thresholds, pd_group_label) + alerting_rules(thresholds, runbook_base, pd_group_label))}]}


def recording_rules(t: Thresholds, group: str) -> list[dict]:
    # In the order the rule file has always had: a rule reads only those above it.
    return (pressure.recording_rules(t) + [latency.finished_rule(t)] + prefix_cache.recording_rules(t)
            + [latency.queue_share_rule(t)] + offload.recording_rules(t) + latency.mean_rules(t)
            + what_if.recording_rules(t) + disaggregated.recording_rules(t, group) + fleet.recording_rules(t, group)
            + routing.recording_rules(t))


def alerting_rules(t: Thresholds, runbook_base: str, group: str) -> list[dict]:
    return (pressure.queue_alerts(t, runbook_base) + pressure.fill_alerts(t, runbook_base)
            + [prefix_cache.hit_rate_drop_alert(t, runbook_base), what_if.capacity_misses_alert(t, runbook_base),
               latency.queue_dominates_alert(t, runbook_base)]
            + offload.alerting_rules(t, runbook_base) + exporter_health.alerting_rules(t, runbook_base)
            + disaggregated.alerting_rules(t, group, runbook_base) + fleet.alerting_rules(t, group, runbook_base)
            + [routing.routing_loss_alert(t, runbook_base)])
