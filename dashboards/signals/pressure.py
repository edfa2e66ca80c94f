"""KV pressure: the exporter's state, the queue, and preemptions."""

from __future__ import annotations

from kvcache_exporter.contract import PRESSURE_REASONS, PRESSURE_STATES, reason_text
from kvcache_exporter.thresholds import Thresholds
from kvcache_exporter.units import format_duration

from kvcache_exporter.dashboards import bands, promql
from kvcache_exporter.dashboards.panels import (Query, describe, no_value_without_source, range_names, stat,
                                                state_timeline, timeseries, value_names, without_source)
from kvcache_exporter.dashboards.view import (PER_TARGET, PREEMPTIONS_PER_MINUTE, PREEMPTIONS_PER_SECOND, RATIO,
                                              REQUESTS, TARGETS, View, legend_of, percent)


def state_names():
    return value_names({index: (state, bands.STATE_COLORS[state]) for index, state in enumerate(PRESSURE_STATES)})


REASONS = tuple(PRESSURE_REASONS)
# A target the exporter cannot poll: ranked above every reason, so it is first in the triage table.
DOWN = "down: the exporter cannot poll it"
DOWN_CODE = len(REASONS)


def reason_words(t: Thresholds, reason: str) -> str:
    """A reason's words (contract.PRESSURE_REASONS) with the marks the dashboards were generated for."""
    marks = {"low_water_ratio": t.low_water_ratio, "high_water_ratio": t.high_water_ratio}
    return reason_text(reason, lambda name: percent(marks[name]), words=True)


def reason_names(t: Thresholds, ranges: bool = False):
    """Reason codes (rank_of_states over kvcache_pressure_reason) named in the contract's words, coloured by their
    state; with `ranges`, each code's name covers [code, code + 1), for values that add a tie-break below 1, and
    the down code follows."""
    names = {code: (reason_words(t, reason), bands.STATE_COLORS[PRESSURE_REASONS[reason].state])
             for code, reason in enumerate(REASONS)}
    if not ranges:
        return value_names(names)
    return range_names({**names, DOWN_CODE: (DOWN, bands.DOWN_COLOR)})


def reason_rank(v: View, by: tuple[str, ...]) -> str:
    return promql.rank_of_states(v.scope, "kvcache_pressure_reason", REASONS, by, label="reason")


def targets_per_state(v: View):
    state_bands = {state: bands.any_present(color) for state, color in bands.STATE_COLORS.items()}
    state_bands["ok"] = bands.neutral()
    return stat(
        "Targets per pressure state",
        describe(
            "How many targets are in each KV pressure state the exporter derives: ok (room to spare), tight "
            f"(usage at or above {percent(v.thresholds.high_water_ratio)}, nothing queued for KV), capped "
            "(requests wait while the KV pool has room: the running-request cap or compute holds them), saturated "
            "(requests queue because KV is full), thrashing (the engine preempts requests to free KV), and down "
            "(the exporter cannot poll it). Each target counts once, by its worst data-parallel rank, as in the "
            "table beside it: the counts add up to its rows.",
            "targets are saturated or thrashing: KV, not compute, limits them; add KV capacity or shed load. "
            "Capped (orange): raise the running cap or add replicas, KV is not the limit. Tight (amber) is the "
            "early warning.",
        ),
        TARGETS,
        [*(Query(promql.count_in_state(v.scope, "kvcache_pressure_state", PRESSURE_STATES, state, PER_TARGET), state,
                 state_bands[state]) for state in PRESSURE_STATES),
         Query(promql.count_where(f"{v.selector('kvcache_target_up')} == 0"), "down", bands.any_present(bands.DOWN_COLOR))],
        bands.neutral(),
    )


def state_now(v: View):
    return stat(
        "Pressure state",
        describe(
            "The worst KV pressure state of the target's pools now, and why (the rule of the exporter that decided "
            "it): ok, tight (nearly full, nothing queued for KV), capped (requests wait while KV has room), "
            "saturated (requests queue because KV is full) or thrashing (preempting requests to free KV). The "
            "numbers behind it are beside it: Waiting requests, KV usage, Preemptions per minute.",
            "saturated or thrashing: requests wait or are recomputed for lack of KV. Follow Waiting for KV "
            "and Preemptions below; reduce concurrency or max sequence length, or add replicas. Capped: the "
            "running cap, not KV, holds requests back; raise it or add replicas.",
        ),
        "none",
        [Query(reason_rank(v, ()), "state")],
        bands.neutral(),
        mappings=reason_names(v.thresholds),
        no_value="No data: no pool polled (see Targets up)",
        trend=False,
    )


def states_over_time(v: View):
    return state_timeline(
        "Pressure state over time",
        describe(
            f"The KV pressure state over time, one lane {v.per} showing the worst state of the pools it covers: "
            "ok, tight (nearly full), capped (queueing with KV room), saturated (queueing for KV) or thrashing "
            "(preempting to free KV).",
            "saturated or thrashing: requests wait or are recomputed for lack of KV. The periods line up with the "
            "waiting and preemption panels next to it; on the fleet dashboard, click the lane to open the target.",
        ),
        Query(promql.rank_of_states(v.scope, "kvcache_pressure_state", PRESSURE_STATES, v.split), v.line()),
        state_names(),
        v.drill_down,
    )


WAITING_SPLIT = (
    "Queued requests split by cause, from the exporter's pressure logic for every engine: waiting for KV "
    "(the pool is full) and waiting with KV room (the running-request cap or compute holds them). Requests "
    "waiting for something else are in neither: vLLM's deferred ones (a KV transfer under way or done, a LoRA "
    "slot, a grammar), a decode pool's transfers (Transfers by stage)."
)


def waiting_now(v: View):
    return stat(
        "Waiting requests",
        describe(
            f"{WAITING_SPLIT} Summed over the selection.",
            "requests wait for KV: the pool is full, see the Pressure row and Headroom. Waiting with KV room "
            "(amber) is the running-request cap or compute: raise the cap or add replicas, not KV.",
        ),
        REQUESTS,
        [
            Query(promql.total(v.scope, "kvcache_requests_waiting_for_kv"), "for KV", bands.any_present()),
            Query(promql.total(v.scope, "kvcache_requests_waiting_with_kv_room"), "with KV room",
                  bands.any_present("yellow")),
        ],
        bands.neutral(),
    )


def waiting(v: View):
    return timeseries(
        f"Waiting requests by cause {v.per}",
        describe(
            f"{WAITING_SPLIT} {v.per.capitalize()}.",
            "requests wait for KV (the red line marks one): add KV capacity or shed load. Waiting with KV room is "
            "a running-cap or compute backlog: the pool state reads capped.",
        ),
        REQUESTS,
        [
            Query(promql.total(v.scope, "kvcache_requests_waiting_for_kv", v.split), v.line("for KV")),
            Query(promql.total(v.scope, "kvcache_requests_waiting_with_kv_room", v.split), v.line("with KV room")),
        ],
        bands.any_present(),
        v.drill_down,
    )


def running(v: View):
    return timeseries(
        f"Running requests {v.per}",
        describe(
            f"Requests in the running batch {v.per}, each holding KV for its whole sequence, and the requests "
            "the engine paused mid-generation for lack of KV (TensorRT-LLM, which counts no preemptions; the "
            "other engines report no paused requests). No engine exposes its running-request cap.",
            "no red band. Running flat while requests wait with KV to spare is the capped state; running flat "
            "with requests waiting for KV, or paused requests, is a KV shortage (see Headroom).",
        ),
        REQUESTS,
        [Query(promql.total(v.scope, "kvcache_requests_running", v.split), v.line()),
         Query(promql.total(v.scope, "kvcache_requests_paused", v.split), v.line() + " paused")],
        bands.neutral(),
        v.drill_down,
    )


def window_note(t: Thresholds) -> str:
    """Preemptions per minute beside a pressure state: which window each reads."""
    return (f" Preemptions per minute are over the rate interval; the state reads the last "
            f"{format_duration(t.window_seconds)} (`window_seconds`), so a target thrashing on preemptions earlier "
            "in that window can read less here.")


def preemptions_per_minute(v: View):
    t = v.thresholds
    return stat(
        "Preemptions per minute" if v.one_target else "Most preemptions per minute",
        describe(
            "Requests the engines preempted (vLLM) or retracted (SGLang) to free KV, per minute, "
            + ("summed over the target's ranks." if v.one_target else "of the target that preempts most.")
            + " Each one throws away computed KV that must be recomputed."
            + without_source("preemptions_total") + window_note(t),
            f"at or above {t.thrashing_preemptions_per_second * 60:g}/min a target counts as thrashing (dark red at "
            f"the critical preemption-storm rate, {t.preemption_storm_critical_per_second * 60:g}/min). Find the "
            "pool in the Preemption rate panel and lower its concurrency or sequence length, or add KV capacity.",
        ),
        PREEMPTIONS_PER_MINUTE,
        [Query(promql.worst(promql.scaled(promql.rate(v.scope, "kvcache_preemptions_total", PER_TARGET), 60)),
               "preemptions")],
        bands.preemption_rate(t, per_seconds=60),
        no_value=no_value_without_source("preemptions_total"),
    )


def preemption_rate(v: View):
    t = v.thresholds
    return timeseries(
        f"Preemption rate {v.per}",
        describe(
            f"Requests preempted (vLLM) or retracted (SGLang) per second to free KV, {v.per}."
            + without_source("preemptions_total"),
            f"from {t.thrashing_preemptions_per_second:g}/s the pool is thrashing (dark red from "
            f"{t.preemption_storm_critical_per_second:g}/s, a critical preemption storm): work is recomputed. "
            "Lower concurrency or max sequence length, or give the target more KV.",
        ),
        PREEMPTIONS_PER_SECOND,
        [Query(promql.rate(v.scope, "kvcache_preemptions_total", v.split), v.line())],
        bands.preemption_rate(t),
        v.drill_down,
        no_value=no_value_without_source("preemptions_total"),
    )


def preempted_share(v: View):
    t = v.thresholds
    by = (v.pd_group, "role")
    return timeseries(
        "Preempted share of completions",
        describe(
            f"Per model ({v.pd_group}) and role: requests preempted (vLLM) or retracted (SGLang) over the requests "
            "finished. Each one is computed again: the share is the part of the work done twice. The autoscaling "
            "signal reads it over its own window (kvcache:fleet_requests_preempted:ratio)."
            + without_source("preemptions_total"),
            f"from {percent(t.preemption_demand_share)} in two windows running, where no KV-bound queue stands, the "
            "autoscaling signal asks for that share of the ready replicas (docs/scaling.md): the running requests do "
            "not fit. Below it, a full pool that preempts now and then.",
        ),
        RATIO,
        [Query(promql.rate_ratio(v.scope, "kvcache_preemptions_total", "kvcache_e2e_request_latency_seconds_count",
                                 by), legend_of(by))],
        bands.preempted_share(t),
        no_value=no_value_without_source("preemptions_total"),
    )
