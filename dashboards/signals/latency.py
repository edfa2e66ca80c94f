"""Latency: quantiles and distributions from the engines' histograms, and the share spent queueing."""

from __future__ import annotations

from kvcache_exporter.thresholds import Thresholds

from kvcache_exporter.dashboards import bands, promql
from kvcache_exporter.dashboards.panels import (Query, describe, heatmap, no_value_without_source, timeseries,
                                                without_source)
from kvcache_exporter.dashboards.view import RATIO, SECONDS, View, legend_of, percent

TTFT = "kvcache_time_to_first_token_seconds"

ITL = "kvcache_inter_token_latency_seconds"

QUEUE_TIME = "kvcache_queue_time_seconds"

# Finished requests: the traffic floor under which the queue share is not shown (as in the alert).
FINISHED = "kvcache_e2e_request_latency_seconds_count"

PER_TARGET_QUANTILE = ("target",)

QUANTILES_SHOW = (
    " Each quantile is one target's, from its engine's own buckets (quantiles cap at the top bucket); "
    "buckets of different engines are never added up, as their bounds differ."
)


def _quantiles(v: View, title: str, histogram: str, shows: str, when_red: str, steps: bands.Steps = bands.neutral()):
    return timeseries(
        title,
        describe(shows + QUANTILES_SHOW + without_source(histogram.removeprefix("kvcache_")), when_red),
        SECONDS,
        [Query(promql.quantile(q, v.scope, histogram, PER_TARGET_QUANTILE),
               legend_of(PER_TARGET_QUANTILE, f"p{q * 100:g}")) for q in v.latency_quantiles],
        steps,
        v.drill_down,
        no_value=no_value_without_source(histogram.removeprefix("kvcache_")),
    )


def _named(v: View, what: str) -> str:
    return f"{what} {'/'.join(f'p{q * 100:g}' for q in v.latency_quantiles)}"


def ttft(v: View):
    return _quantiles(
        v, _named(v, "Time to first token"), TTFT,
        "Arrival to first output token (queueing included).",
        f"above {v.thresholds.shortage_critical_ttft_seconds:g} s (shortage_critical_ttft_seconds): while requests "
        "queue for KV, a mean TTFT above it pages (KVCacheShortageQueueing); set it to your latency target. If TTFT "
        "rises with Queue time, requests wait for capacity; see Share of TTFT spent queueing.",
        bands.time_to_first_token(v.thresholds),
    )


def itl(v: View):
    return _quantiles(
        v, _named(v, "Inter-token latency"), ITL,
        "Gap between output tokens while decoding.",
        "no absolute red. ITL rising with running requests is a large batch (compute); with preemptions, "
        "recomputation after KV ran out.",
    )


def queue_time(v: View):
    return _quantiles(
        v, _named(v, "Queue time"), QUEUE_TIME,
        "Time a request waits before its first forward pass. Engines record it when a request is "
        "scheduled or finishes, so it shows a shortage an interval late; the waiting gauges show it at once.",
        "no absolute red; see Share of TTFT spent queueing, which turns red when queueing dominates.",
    )


def queue_share(scope: promql.Scope, by: tuple[str, ...], t: Thresholds) -> str:
    """Seconds spent queueing per second of TTFT, in [0, 1], where requests finish above the traffic floor."""
    busy = promql.at_least(promql.rate(scope, FINISHED, by), t.traffic_floor_requests_per_second)
    return promql.share_of_sums(scope, QUEUE_TIME, TTFT, by, busy)


def queue_share_of_ttft(v: View):
    t = v.thresholds
    return timeseries(
        "Share of TTFT spent queueing",
        describe(
            f"Seconds requests spent queueing per second of time to first token, {v.per}: "
            "rate(queue time sum) / rate(TTFT sum), capped at 100 %, shown while at least "
            f"{t.traffic_floor_requests_per_second:g} requests/s finish (the alert's traffic floor). A ratio of "
            "the histograms' sums, so the engines' bucket bounds cannot distort it."
            + without_source(QUEUE_TIME.removeprefix("kvcache_")),
            f"above {percent(t.queue_share_of_ttft)} queueing dominates TTFT (KVCacheQueueDominatesTTFT): the "
            "target lacks capacity, not speed. If its pressure state is saturated, KV is short; if capped, the "
            "running cap is. Scale out or route traffic away.",
        ),
        RATIO,
        [Query(queue_share(v.scope, v.split, t), v.line())],
        bands.queue_share(t),
        v.drill_down,
        min_max=(0, 1),
        no_value=no_value_without_source(QUEUE_TIME.removeprefix("kvcache_")),
    )


def _latency_heatmap(v: View, title: str, histogram: str, shows: str):
    return heatmap(
        title,
        describe(shows + " Requests per bucket and interval; darker cells hold more requests.",
              "no red band: look for a second band of cells far above the first, requests that waited for KV "
              "while others were served at once."),
        SECONDS,
        Query(promql.bucket_increase(v.scope, histogram), "{{le}}"),
    )


def ttft_heatmap(v: View):
    return _latency_heatmap(v, "Time to first token distribution", TTFT, "Time to first token of every request.")


def queue_time_heatmap(v: View):
    return _latency_heatmap(v, "Queue time distribution", QUEUE_TIME, "Time every request waited before scheduling.")
