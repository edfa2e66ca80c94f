"""NVIDIA Dynamo's own series (ai-dynamo/dynamo: components/src/dynamo/common/utils/prometheus.py
and the names in prometheus_names, 1.6), read where no engine page is available: a worker's system
port with only `dynamo_component_*`, or the frontend's /metrics with `dynamo_frontend_*`.

A worker port that passes the engine's own page through (`vllm:*`, `sglang:*`, `trtllm_*`) is read by
that engine's adapter, so the numbers keep the name of the engine that produced them.
The frontend's queue, in-flight count and latencies are measured at the frontend, not in the
engine; its per-worker KV block counts are the router's predictions and are not read at all.
"""

from __future__ import annotations

from .base import NO_KV_TRANSFER, NO_POOL_DETAIL, NO_RUNNING_CAP, PREFIX_AND_TOKEN_COUNTERS, Adapter, Series


class DynamoAdapter(Adapter):
    engine = "dynamo"
    title = "Dynamo"
    marker = r"dynamo_(?:component|frontend)_"
    detect_last = True
    rank_label = "dp_rank"
    model_label = "model"
    # The frontend's prefix-hit tokens are router predictions: not read.
    # Its router's transfer-latency estimate is an upper bound from the frontend, not a transfer: not read.
    not_reported = NO_POOL_DETAIL | NO_RUNNING_CAP | PREFIX_AND_TOKEN_COUNTERS | NO_KV_TRANSFER | {
        "queue_time_seconds", "requests_paused", "requests_finished_total"}
    series = (
        # 0..1 despite the name; the worker copies it from the engine's KV stats.
        Series("usage_ratio", ("dynamo_component_gpu_cache_usage_percent",
                               "dynamo_component_kvstats_gpu_cache_usage_percent")),
        Series("capacity_blocks", ("dynamo_component_total_blocks", "dynamo_component_kvstats_total_blocks")),
        Series("block_size_tokens", ("dynamo_frontend_model_kv_cache_block_size",)),
        Series("requests_running", ("dynamo_frontend_inflight_requests",)),
        # Waiting for the first response: prefill time included.
        Series("requests_waiting", ("dynamo_frontend_queued_requests",)),
        Series("time_to_first_token_seconds", ("dynamo_frontend_time_to_first_token_seconds",), "histogram"),
        Series("inter_token_latency_seconds", ("dynamo_frontend_inter_token_latency_seconds",), "histogram"),
        Series("e2e_request_latency_seconds", ("dynamo_frontend_request_duration_seconds",), "histogram"),
    )
