"""The fleet's first panel: one row per target, the pools that need help first."""

from __future__ import annotations

from kvcache_exporter.contract import PRESSURE_STATES

from kvcache_exporter.dashboards import bands, promql
from kvcache_exporter.dashboards.panels import Column, describe, table
from kvcache_exporter.dashboards.signals import kv, latency, pressure
from kvcache_exporter.dashboards.view import HEADROOM_UNIT, PER_TARGET, RATIO, SECONDS, View

STATE = "State"
TRIAGE_QUANTILE = 0.9
# The header names what a count column counts; "304 requests" or "252 preemptions/min" in every cell would not
# fit nine columns in 1200 px, and Grafana clips a right-aligned cell's number first.
COUNT = "none"


def pools_needing_help(v: View):
    t = v.thresholds
    s = v.scope
    columns = [
        Column(STATE, promql.rank_of_states(s, "kvcache_pressure_state", PRESSURE_STATES, PER_TARGET), "none",
               bands.neutral(), pressure.state_names()),
        Column("KV usage", promql.highest(s, "kvcache_usage_ratio", PER_TARGET), RATIO, bands.usage(t)),
        Column("Headroom", promql.least(v.selector(kv.HEADROOM), PER_TARGET), HEADROOM_UNIT, bands.headroom()),
        Column("Waiting for KV", promql.total(s, "kvcache_requests_waiting_for_kv", PER_TARGET), COUNT,
               bands.any_present()),
        Column("Waiting with KV room", promql.total(s, "kvcache_requests_waiting_with_kv_room", PER_TARGET),
               COUNT, bands.any_present("yellow")),
        Column("Running", promql.total(s, "kvcache_requests_running", PER_TARGET), COUNT, bands.neutral()),
        Column("Preemptions/min", promql.scaled(promql.rate(s, "kvcache_preemptions_total", PER_TARGET), 60),
               COUNT, bands.preemption_rate(t, per_seconds=60)),
        Column(f"TTFT p{TRIAGE_QUANTILE * 100:g}",
               promql.quantile(TRIAGE_QUANTILE, s, latency.TTFT, PER_TARGET), SECONDS, bands.neutral()),
    ]
    return table(
        "Pools that need help now",
        describe(
            "One row per target, worst pressure state first. State, KV usage and headroom are those of its "
            "worst data-parallel rank; waiting, running and preemptions are summed over its ranks; TTFT "
            f"p{TRIAGE_QUANTILE * 100:g} comes from the target's own histogram over the rate interval. Filter "
            "the table or sort by any column; click a target to open it." + pressure.window_note(t),
            "the state column names what limits the pool: saturated or thrashing is KV (add KV capacity, shed "
            "load), capped is the running-request cap (raise it or add replicas). Headroom below 1 means the "
            "next typical request does not fit.",
        ),
        "target",
        columns,
        sort_by=STATE,
        links=v.drill_down,
    )
