"""The exporter's polls of its targets: can the other panels be trusted?"""

from __future__ import annotations

from kvcache_exporter.dashboards import bands, promql
from kvcache_exporter.dashboards.panels import Query, describe, stat, state_timeline, timeseries, value_names
from kvcache_exporter.dashboards.view import FAILURES_PER_SECOND, PER_TARGET, SECONDS, TARGETS, View


def targets_up(v: View):
    return stat(
        "Targets up",
        describe(
            "Engines the exporter polled successfully on its last poll (up), and those whose last poll failed (down).",
            "a target is down: its KV series vanish after the exporter's staleness period. See Exporter health "
            "for the failure reason (timeout, connect, http_status, parse, ...) and check the engine and its /metrics.",
        ),
        TARGETS,
        [
            Query(f"sum({v.selector('kvcache_target_up')})", "up"),
            Query(f"count({v.selector('kvcache_target_up')} == 0) or vector(0)", "down", bands.any_present()),
        ],
        bands.neutral(),
    )


def target_up_over_time(v: View):
    return state_timeline(
        "Targets up over time",
        describe("Whether the exporter's last poll of each target succeeded and parsed.",
              "polls of the target fail: see Poll failures by reason. Its KV series vanish after the exporter's "
              "staleness period, so the other panels go blank for it rather than freeze."),
        Query(promql.highest(v.scope, "kvcache_target_up", PER_TARGET), "{{target}}"),
        value_names({0: ("down", "red"), 1: ("up", "green")}),
        v.drill_down,
    )


def poll_duration(v: View):
    return timeseries(
        "Poll duration",
        describe("How long the exporter's last poll of each target's /metrics took.",
              "no red band: a duration close to the configured timeout (default 0.8 x poll interval) turns into "
              "timeout failures. Look at the engine's load or the network, or raise the timeout."),
        SECONDS,
        [Query(promql.highest(v.scope, "kvcache_target_scrape_duration_seconds", PER_TARGET), "{{target}}")],
        bands.neutral(),
        v.drill_down,
    )


def poll_failures(v: View):
    return timeseries(
        "Poll failures by reason",
        describe("Failed polls per second, by target and reason (timeout, connect, http_status, too_large, parse, "
              "unknown_engine); only reasons that occurred in the window are drawn.",
              "no red band (Targets up turns red). connect/timeout: the engine is down or slow; http_status: "
              "wrong URL or auth; parse/unknown_engine: an engine version the exporter does not understand yet."),
        FAILURES_PER_SECOND,
        [Query(promql.rate(v.scope, "kvcache_target_scrape_failures_total", ("target", "reason")) + " > 0",
               "{{target}} {{reason}}")],
        bands.neutral(),
        v.drill_down,
    )


def since_last_good_poll(v: View):
    return timeseries(
        "Time since last good poll",
        describe("Seconds since the exporter last polled each target successfully.",
              "no red band: it should stay near the poll interval. Growth means failing polls (see Poll failures); "
              "past the staleness period the target's KV series disappear."),
        SECONDS,
        [Query(f"time() - {promql.highest(v.scope, 'kvcache_target_last_success_timestamp_seconds', PER_TARGET)}",
               "{{target}}")],
        bands.neutral(),
    )
