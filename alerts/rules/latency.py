"""Latency: how many requests finish (the traffic floor of the rate-based alerts), the share of the time to first
token spent queueing, the mean queue time and time to first token, and the alert on a queue that dominates TTFT."""

from __future__ import annotations

from kvcache_exporter.alerts.rules.common import WHERE, alert, number, target_rate, with_traffic
from kvcache_exporter.thresholds import Thresholds
from kvcache_exporter.units import format_duration


def finished_rule(t: Thresholds) -> dict:
    # Finished requests: the traffic floor of the rate-based alerts.
    return {"record": "kvcache:requests_finished:rate",
            "expr": target_rate("kvcache_e2e_request_latency_seconds_count", format_duration(t.window_seconds))}


def queue_share_rule(t: Thresholds) -> dict:
    # Seconds spent queueing per second of TTFT: a ratio of the histograms' sums, which no bucket
    # bound enters. A quotient of two interpolated p90s is not: vLLM's queue buckets start at
    # 0.3 s and its TTFT buckets at 1 ms, so an empty queue read as 0.27 s against a 0.08 s TTFT.
    # Capped at 1: vLLM records queue time at finish and TTFT at the first token, so in one
    # window the two sums can cover different requests.
    w = format_duration(t.window_seconds)
    return {"record": "kvcache:queue_share_of_ttft:ratio", "expr": (
        f"clamp_max(\n  {target_rate('kvcache_queue_time_seconds_sum', w)}\n"
        f"  /\n  ({target_rate('kvcache_time_to_first_token_seconds_sum', w)} > 0),\n  1\n)"
    )}


def mean_rules(t: Thresholds) -> list[dict]:
    w = format_duration(t.window_seconds)

    def mean(histogram: str) -> str:
        return f"{target_rate(histogram + '_sum', w)}\n/\n({target_rate(histogram + '_count', w)} > 0)"

    return [
        {"record": "kvcache:queue_time_seconds:mean", "expr": mean("kvcache_queue_time_seconds")},
        {"record": "kvcache:time_to_first_token_seconds:mean", "expr": mean("kvcache_time_to_first_token_seconds")},
    ]


def queue_dominates_alert(t: Thresholds, runbook_base: str) -> dict:
    return alert(
        "KVCacheQueueDominatesTTFT", "warning",
        with_traffic(f"kvcache:queue_share_of_ttft:ratio > {number(t.queue_share_of_ttft)}",
                     "kvcache:requests_finished:rate", t.traffic_floor_requests_per_second),
        t.queue_dominates_for,
        f"{WHERE}: most of the time to first token is spent queueing",
        f"Queueing is {{{{ $value | humanizePercentage }}}} of the time to first token on {WHERE} over "
        f"{format_duration(t.window_seconds)}: "
        "requests wait for a place to run (KV or the running-request cap), not for their prefill.",
        runbook_base,
    )
