"""KV pressure: the exporter's state, the queue, and preemptions."""

from __future__ import annotations

from exporter.derive import PRESSURE_STATES

from dashboards import bands, promql
from dashboards.panels import Query, describe, stat, state_timeline, timeseries, value_names
from dashboards.view import PER_TARGET, PREEMPTIONS_PER_MINUTE, PREEMPTIONS_PER_SECOND, REQUESTS, TARGETS, View, percent


def _state_names():
    return value_names({index: (state, bands.STATE_COLORS[state]) for index, state in enumerate(PRESSURE_STATES)})


def targets_per_state(v: View):
    state_bands = {"ok": bands.neutral(), "tight": bands.any_present("yellow"),
                   "saturated": bands.any_present("red"), "thrashing": bands.any_present("dark-red")}
    return stat(
        "Targets per pressure state",
        describe(
            "How many targets are in each KV pressure state the exporter derives: ok (room to spare), tight "
            f"(usage at or above {percent(v.thresholds.high_water_ratio)}, nothing queued for KV), saturated "
            "(requests queue because KV is full), thrashing (the engine preempts requests to free KV). A target "
            "with several data-parallel ranks counts in every state one of its ranks is in.",
            "targets are saturated or thrashing: KV, not compute, limits them. Open the target from Pressure state "
            "over time, then add capacity or shed load; tight (amber) is the early warning.",
        ),
        TARGETS,
        [Query(promql.count_in_state(v.scope, "kvcache_pressure_state", state, PER_TARGET), state, state_bands[state])
         for state in PRESSURE_STATES],
        bands.neutral(),
    )


def state_now(v: View):
    return stat(
        "Pressure state",
        describe(
            "The worst KV pressure state of the target's pools now: ok, tight (nearly full, nothing queued for KV), "
            "saturated (requests queue because KV is full) or thrashing (preempting requests to free KV).",
            "saturated or thrashing: requests wait or are recomputed for lack of KV. Follow Waiting for capacity "
            "and Preemptions below; reduce concurrency or max sequence length, or add replicas.",
        ),
        "none",
        [Query(promql.rank_of_states(v.scope, "kvcache_pressure_state", PRESSURE_STATES, ()), "state")],
        bands.neutral(),
        mappings=_state_names(),
    )


def states_over_time(v: View):
    return state_timeline(
        "Pressure state over time",
        describe(
            f"The KV pressure state over time, one lane {v.per} showing the worst state of the pools it covers: "
            "ok, tight (nearly full), saturated (queueing for KV) or thrashing (preempting to free KV).",
            "saturated or thrashing: requests wait or are recomputed for lack of KV. The periods line up with the "
            "waiting and preemption panels next to it; on the fleet dashboard, click the lane to open the target.",
        ),
        Query(promql.rank_of_states(v.scope, "kvcache_pressure_state", PRESSURE_STATES, v.split), v.line()),
        _state_names(),
        v.drill_down,
    )


def waiting_now(v: View):
    return stat(
        "Waiting requests",
        describe(
            "Requests queued and not yet scheduled (waiting), and the part of them that waits for KV or batch "
            "capacity (for capacity; vLLM only, SGLang does not say why a request waits).",
            "requests wait for capacity: the engine has no KV (or hit its running cap) for them. If KV usage is "
            "high too, KV is the limit: see the Pressure row; if not, the running-request cap is.",
        ),
        REQUESTS,
        [
            Query(promql.total(v.scope, "kvcache_requests_waiting"), "waiting"),
            Query(promql.total(v.scope, "kvcache_requests_waiting_for_capacity"), "for capacity", bands.any_present()),
        ],
        bands.neutral(),
    )


def waiting(v: View):
    return timeseries(
        "Waiting vs waiting for capacity",
        describe(
            f"Queued requests {v.per}, and the part that waits for KV or batch capacity (vLLM only).",
            "requests wait for capacity (the red line marks one): KV is full if usage is high at the same time, "
            "else the running-request cap is the limit. Waiting without capacity waits is a compute or "
            "scheduling backlog.",
        ),
        REQUESTS,
        [
            Query(promql.total(v.scope, "kvcache_requests_waiting", v.split), v.line("waiting")),
            Query(promql.total(v.scope, "kvcache_requests_waiting_for_capacity", v.split), v.line("for capacity")),
        ],
        bands.any_present(),
        v.drill_down,
    )


def running(v: View):
    return timeseries(
        "Running requests",
        describe(
            f"Requests in the running batch {v.per}: each holds KV for its whole sequence.",
            "no red band. Running flat while waiting grows means the batch cannot grow: KV (see KV usage) or the "
            "running-request cap stops it.",
        ),
        REQUESTS,
        [Query(promql.total(v.scope, "kvcache_requests_running", v.split), v.line())],
        bands.neutral(),
        v.drill_down,
    )


def preemptions_per_minute(v: View):
    t = v.thresholds
    return stat(
        "Preemptions per minute",
        describe(
            "Requests the engines preempted (vLLM) or retracted (SGLang) to free KV, per minute, summed over the "
            "selection. Each one throws away computed KV that must be recomputed.",
            f"at or above {t.thrashing_preemptions_per_second * 60:g}/min a target counts as thrashing (dark red at "
            f"the critical preemption-storm rate, {t.preemption_storm_critical_per_second * 60:g}/min). Find the "
            "pool in the Preemption rate panel and lower its concurrency or sequence length, or add KV capacity.",
        ),
        PREEMPTIONS_PER_MINUTE,
        [Query(promql.scaled(promql.rate(v.scope, "kvcache_preemptions_total"), 60), "preemptions")],
        bands.preemption_rate(t, per_seconds=60),
    )


def preemption_rate(v: View):
    t = v.thresholds
    return timeseries(
        f"Preemption rate {v.per}",
        describe(
            f"Requests preempted (vLLM) or retracted (SGLang) per second to free KV, {v.per}.",
            f"from {t.thrashing_preemptions_per_second:g}/s the pool is thrashing (dark red from "
            f"{t.preemption_storm_critical_per_second:g}/s, a critical preemption storm): work is recomputed. "
            "Lower concurrency or max sequence length, or give the target more KV.",
        ),
        PREEMPTIONS_PER_SECOND,
        [Query(promql.rate(v.scope, "kvcache_preemptions_total", v.split), v.line())],
        bands.preemption_rate(t),
        v.drill_down,
    )
