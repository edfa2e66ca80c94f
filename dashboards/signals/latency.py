"""Latency: quantiles and distributions from the engines' histograms, and the share spent queueing."""

from __future__ import annotations

from exporter.thresholds import Thresholds

from dashboards import bands, promql
from dashboards.panels import Query, describe, heatmap, timeseries
from dashboards.view import RATIO, SECONDS, View, percent

LATENCY_QUANTILES = (0.5, 0.9, 0.99)

# KVCacheQueueDominatesTTFT compares p90s (see Thresholds.queue_share_of_ttft).
QUEUE_SHARE_QUANTILE = 0.9

TTFT = "kvcache_time_to_first_token_seconds"

ITL = "kvcache_inter_token_latency_seconds"

QUEUE_TIME = "kvcache_queue_time_seconds"


def _quantiles(v: View, title: str, histogram: str, shows: str, when_red: str):
    return timeseries(
        title,
        describe(shows + " Quantiles over the selection from the engines' own buckets; they cap at the top bucket.",
              when_red),
        SECONDS,
        [Query(promql.quantile(q, v.scope, histogram), f"p{q * 100:g}") for q in LATENCY_QUANTILES],
        bands.neutral(),
    )


def ttft(v: View):
    return _quantiles(
        v, "Time to first token", TTFT,
        "Arrival to first output token (queueing included), p50/p90/p99.",
        "no absolute red (latency targets are per service). If TTFT rises with Queue time, requests wait for "
        "capacity; see Share of TTFT spent queueing.",
    )


def itl(v: View):
    return _quantiles(
        v, "Inter-token latency", ITL,
        "Gap between output tokens while decoding, p50/p90/p99.",
        "no absolute red. ITL rising with running requests is a large batch (compute); with preemptions, "
        "recomputation after KV ran out.",
    )


def queue_time(v: View):
    return _quantiles(
        v, "Queue time", QUEUE_TIME,
        "Time a request waits before its first forward pass, p50/p90/p99. Engines record it when a request is "
        "scheduled or finishes, so it shows a shortage an interval late; the waiting gauges show it at once.",
        "no absolute red; see Share of TTFT spent queueing, which turns red when queueing dominates.",
    )


def queue_share_of_ttft(v: View):
    t = v.thresholds
    q = QUEUE_SHARE_QUANTILE
    return timeseries(
        "Share of TTFT spent queueing",
        describe(
            f"p{q * 100:g} queue time divided by p{q * 100:g} time to first token, {v.per}: how much of the wait "
            "for the first token is queueing rather than prefill.",
            f"above {percent(t.queue_share_of_ttft)} queueing dominates TTFT (KVCacheQueueDominatesTTFT): the "
            "target lacks capacity, not speed. If its pressure state is saturated, KV is short; otherwise the "
            "running cap or compute is. Scale out or route traffic away.",
        ),
        RATIO,
        [Query(promql.ratio(promql.quantile(q, v.scope, QUEUE_TIME, v.split),
                            promql.quantile(q, v.scope, TTFT, v.split)), v.line())],
        bands.queue_share(t),
        v.drill_down,
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
