"""The fleet's first panel: one row per target, the pools that need help first."""

from __future__ import annotations

from kvcache_exporter.dashboards import bands, promql
from kvcache_exporter.dashboards.panels import Column, describe, table
from kvcache_exporter.dashboards.signals import kv, latency, pressure
from kvcache_exporter.dashboards.view import PER_TARGET, RATIO, SECONDS, View

STATE = "State"
TRIAGE_QUANTILE = 0.9
# The header names what a count column counts, the description what headroom counts; "304 requests" or "1.23K
# requests" in every cell would not fit nine columns in 1200 px, and Grafana clips a right-aligned cell's number
# first.
COUNT = "none"
# The State column says why in words, wide enough for the longest on one line at 1200 px ("capped: none running,
# the engine admits nothing": at 300 px two reasons lost their start, and wrapped they ran into the next row: Grafana
# sizes a row by a mapped value's number, not its words); the others share the rest down to
# panels.TABLE_COLUMN_MIN_WIDTH, the targets' names wrapping where longer.
STATE_WIDTH = 380
# KV usage to one decimal of a percent in every cell, the precision the sort key ties on: Grafana's own choice
# (about three significant digits) shows 23.6% and 23.9% for what a whole-percent key called a tie.
USAGE_DECIMALS = 1


def worst_first(v: View) -> str:
    """The State column's value, a sort key: the worst reason's code of the target's ranks (pressure.reason_rank),
    plus below 1 its fullest rank's usage in tenths of a percent, rounded as the KV usage column shows it
    (x 0.0009), and then its waiting requests (w / (w + 1), x 0.0009), so that a descending sort puts the worst
    state first and ties by usage, then waiting; a target that is down reads the down code, above every reason."""
    s = v.scope
    ranked = pressure.reason_rank(v, PER_TARGET)
    step = 10 ** -(USAGE_DECIMALS + 2)  # one tenth of a percent, as a ratio
    usage = f"round(clamp_max({promql.highest(s, 'kvcache_usage_ratio', PER_TARGET)}, 1), {step:g}) * 0.9"
    waiting = promql.total(s, "kvcache_requests_waiting", PER_TARGET)
    queue = f"({0.9 * step:g} * {waiting} / ({waiting} + 1) or on (target) 0 * {ranked})"
    down = f"max by (target) ({v.selector('kvcache_target_up')} == 0) + {pressure.DOWN_CODE}"
    return f"(\n  {ranked}\n  + on (target) {usage}\n  + on (target) {queue}\n)\nor on (target)\n{down}"


def pools_needing_help(v: View):
    t = v.thresholds
    s = v.scope
    columns = [
        Column(STATE, worst_first(v), "none", bands.neutral(), pressure.reason_names(t, ranges=True), STATE_WIDTH),
        Column("KV usage", promql.highest(s, "kvcache_usage_ratio", PER_TARGET), RATIO, bands.usage(t),
               decimals=USAGE_DECIMALS),
        Column("Headroom", promql.least(v.selector(kv.HEADROOM), PER_TARGET), COUNT, bands.headroom()),
        Column("Waiting for KV", promql.total(s, "kvcache_requests_waiting_for_kv", PER_TARGET), COUNT,
               bands.any_present()),
        Column("Waiting with KV room", promql.total(s, "kvcache_requests_waiting_with_kv_room", PER_TARGET),
               COUNT, bands.any_present("yellow")),
        Column("Running", promql.total(s, "kvcache_requests_running", PER_TARGET), COUNT, bands.neutral()),
        Column("Preempted per min", promql.scaled(promql.rate(s, "kvcache_preemptions_total", PER_TARGET), 60),
               COUNT, bands.preemption_rate(t, per_seconds=60)),
        Column(f"TTFT p{TRIAGE_QUANTILE * 100:g}",
               promql.quantile(TRIAGE_QUANTILE, s, latency.TTFT, PER_TARGET), SECONDS, bands.neutral()),
    ]
    return table(
        "Pools that need help now",
        describe(
            "One row per target, worst pressure state first, then the fullest, then the longest queue; targets the "
            "exporter cannot poll come first, as down. State says why (the exporter's rule, in the words of "
            "docs/metrics.md) and the columns beside it hold the numbers. State, KV usage and headroom are those of "
            "its worst data-parallel rank; waiting, running and preemptions are summed over its ranks; TTFT "
            f"p{TRIAGE_QUANTILE * 100:g} comes from the target's own histogram over the rate interval. Filter "
            "by target or state, sort by any column; click a target to open it." + pressure.window_note(t),
            "the state column names what limits the pool: saturated or thrashing is KV (add KV capacity, shed "
            "load), capped is the running-request cap (raise it or add replicas). Headroom counts the typical "
            "requests that still fit: below 1 the next one does not.",
        ),
        "target",
        columns,
        sort_by=STATE,
        links=v.drill_down,
    )
