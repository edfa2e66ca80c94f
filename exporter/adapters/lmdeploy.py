"""LMDeploy's api_server /metrics (InternLM/lmdeploy lmdeploy/metrics/loggers.py, v0.9.2 on; on by
default since v0.11.0): vLLM-like names under `lmdeploy:`, labels `model_name` and `engine` (the DP
rank). No blocks, no capacity and no preemption counter: those families stay absent."""

from __future__ import annotations

from .base import NO_KV_TRANSFER, NO_POOL_DETAIL, NO_RUNNING_CAP, Adapter, Series


class LmdeployAdapter(Adapter):
    engine = "lmdeploy"
    title = "LMDeploy"
    marker = r"lmdeploy[:_]"
    prefix_aliases = ("lmdeploy_",)
    rank_label = "engine"
    not_reported = NO_POOL_DETAIL | NO_RUNNING_CAP | NO_KV_TRANSFER | {"capacity_blocks", "block_size_tokens",
                                                                       "prefix_cache_min_hit_tokens", "requests_paused",
                                                                       "requests_finished_total"}
    series = (
        Series("usage_ratio", ("lmdeploy:gpu_cache_usage_perc",)),
        Series("requests_running", ("lmdeploy:num_requests_running",)),
        Series("requests_waiting", ("lmdeploy:num_requests_waiting",)),
        # Both counted per request: the prompt at its first iteration, the cached part when it finishes.
        Series("prefix_cache_queried_tokens_total", ("lmdeploy:prompt_tokens_total",), "counter"),
        Series("prefix_cache_hit_tokens_total", ("lmdeploy:cached_tokens_total",), "counter"),
        Series("prompt_tokens_total", ("lmdeploy:prompt_tokens_total",), "counter"),
        Series("generation_tokens_total", ("lmdeploy:generation_tokens_total",), "counter"),
        Series("time_to_first_token_seconds", ("lmdeploy:time_to_first_token_seconds",), "histogram"),
        Series("inter_token_latency_seconds",
               ("lmdeploy:iter_token_latency", "lmdeploy:time_per_output_token_seconds"), "histogram"),
        Series("queue_time_seconds", ("lmdeploy:request_queue_time_seconds",), "histogram"),
        Series("e2e_request_latency_seconds", ("lmdeploy:e2e_request_latency_seconds",), "histogram"),
    )
