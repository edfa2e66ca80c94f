"""Triton Inference Server with the TensorRT-LLM backend (triton-inference-server/tensorrtllm_backend
inflight_batcher_llm/src/custom_metrics_reporter/custom_metrics_reporter.cc, now
NVIDIA/TensorRT-LLM triton_backend/): one gauge family per topic, the value picked by a category
label, on Triton's metrics port (8002). Labels `model` (the Triton model) and `version`.

The families were `*_statistics` in the first releases and `*_metrics` since; `request_type="waiting"`
and `kv_cache_block_type="fraction"` came with v0.18. There are no latency histograms and no
preemption counter: those families stay absent.
"""

from __future__ import annotations

import math

from .base import NO_KV_TRANSFER, NO_POOL_DETAIL, PREFIX_AND_TOKEN_COUNTERS, Adapter, Samples, Series
from ..snapshot import Histogram, Snapshot

KV = ("nv_trt_llm_kv_cache_block_metrics", "nv_trt_llm_kv_cache_block_statistics")
REQUESTS = ("nv_trt_llm_request_metrics", "nv_trt_llm_request_statistics")
# Disaggregated serving: counters of the KV transfers' milliseconds and of the requests transferred.
DISAGGREGATED = "nv_trt_llm_disaggregated_serving_metrics"


def _kv(kind: str) -> dict[str, str]:
    return {"kv_cache_block_type": kind}


def _requests(kind: str) -> dict[str, str]:
    return {"request_type": kind}


class TritonAdapter(Adapter):
    engine = "triton"
    title = "Triton TensorRT-LLM"
    marker = r"nv_trt_llm_"
    rank_label = None  # one executor (one KV pool) per model instance
    model_label = "model"
    # `reused` counts blocks with no queried denominator; the backend has no latency histograms.
    not_reported = NO_POOL_DETAIL | PREFIX_AND_TOKEN_COUNTERS | (NO_KV_TRANSFER - {"kv_transfer_seconds"}) | {
        "time_to_first_token_seconds", "inter_token_latency_seconds", "queue_time_seconds",
        "e2e_request_latency_seconds", "requests_finished_total"}
    series = (
        Series("usage_ratio", KV, match=_kv("fraction")),
        Series("capacity_blocks", KV, match=_kv("max")),
        Series("used_blocks", KV, match=_kv("used")),
        Series("block_size_tokens", KV, match=_kv("tokens_per")),
        # Scheduled this iteration; `active` also counts admitted requests that were not.
        Series("requests_running", REQUESTS, match=_requests("scheduled")),
        Series("requests_running_max", REQUESTS, match=_requests("max")),
        # active - scheduled: admitted but not scheduled (e.g. short of KV); the executor's own queue
        # is not exported.
        Series("requests_waiting", REQUESTS, match=_requests("waiting")),
        Series("requests_paused", ("nv_trt_llm_inflight_batcher_metrics",),
               match={"inflight_batcher_specific_metric": "paused_requests"}),
    )
    extra_names = (*REQUESTS, DISAGGREGATED)

    def complete(self, samples: Samples, snapshot: Snapshot) -> None:
        """Before v0.18 `waiting` is missing: it is active - scheduled, which the page has. The transfer counters
        are a histogram with its +Inf bucket only: their sum and count."""
        name = self.first_present(REQUESTS, samples)
        if name is not None:
            by_type = {s.labels.get("request_type"): s.value for s in samples[name]}
            if "active" in by_type and "scheduled" in by_type:
                for rank in snapshot.ranks.values():
                    rank.gauges.setdefault("requests_waiting", max(0.0, by_type["active"] - by_type["scheduled"]))
        transfers = {s.labels.get("disaggregated_serving_type"): s.value for s in samples.get(DISAGGREGATED, ())}
        milliseconds, count = transfers.get("kv_cache_transfer_ms"), transfers.get("request_count")
        if milliseconds is not None and count is not None and math.isfinite(milliseconds + count):
            for rank in snapshot.ranks.values():
                rank.histograms["kv_transfer_seconds"] = Histogram([(math.inf, count)], milliseconds / 1000, count)
