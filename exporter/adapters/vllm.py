"""vLLM V0 and V1: wire names across versions (reference §2)."""

from __future__ import annotations

import math

from .base import Adapter, Samples, Series
from ..snapshot import RankValues, Snapshot

# Bucketed `priority` slices (with --scheduling-policy priority) partition the requests: sum them.
_REQUEST_SLICES = ("priority",)


class VllmAdapter(Adapter):
    engine = "vllm"
    marker = r"vllm[:_]"
    prefix_aliases = ("vllm_",)
    rank_label = "engine"  # V1's data-parallel engine index; V0 has none
    extra_names = ("vllm:cache_config_info",)
    series = (
        Series("usage_ratio", ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")),
        Series("requests_running", ("vllm:num_requests_running",)),
        Series("requests_waiting", ("vllm:num_requests_waiting",)),
        Series("requests_waiting_for_capacity", ("vllm:num_requests_waiting_by_reason",), match={"reason": "capacity"}),
        Series("preemptions_total", ("vllm:num_preemptions_total",), "counter"),
        Series("prefix_cache_queried_tokens_total",
               ("vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total"), "counter"),
        Series("prefix_cache_hit_tokens_total",
               ("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total"), "counter"),
        Series("prompt_tokens_total", ("vllm:prompt_tokens_total",), "counter"),
        Series("generation_tokens_total", ("vllm:generation_tokens_total",), "counter"),
        Series("time_to_first_token_seconds", ("vllm:time_to_first_token_seconds",), "histogram",
               sum_over=_REQUEST_SLICES),
        Series("inter_token_latency_seconds",
               ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"), "histogram"),
        Series("queue_time_seconds", ("vllm:request_queue_time_seconds",), "histogram", sum_over=_REQUEST_SLICES),
        Series("e2e_request_latency_seconds", ("vllm:e2e_request_latency_seconds",), "histogram",
               sum_over=_REQUEST_SLICES),
    )

    def complete(self, samples: Samples, snapshot: Snapshot) -> None:
        """Capacity from `cache_config_info` labels: one block of `num_gpu_blocks` is the null block."""
        name = self.first_present(("vllm:cache_config_info",), samples)
        for sample in samples.get(name, ()) if name else ():
            labels = sample.labels
            # Before the `engine` label (#15755) one info series described every engine alike.
            ranks = [labels["engine"]] if "engine" in labels else list(snapshot.ranks) or ["0"]
            values = {}
            blocks = _number(labels.get("num_gpu_blocks"))
            if blocks is not None and blocks > 1:
                values["capacity_blocks"] = blocks - 1
            block_size = _number(labels.get("block_size"))
            if block_size:
                values["block_size_tokens"] = block_size
            # Group-aware token capacity (hybrid models) where the engine states it (#42206).
            tokens = _number(labels.get("kv_cache_size_tokens"))
            if tokens:
                values["capacity_tokens"] = tokens
            for rank in ranks:
                snapshot.ranks.setdefault(rank, RankValues()).gauges.update(values)


def _number(text: str | None) -> float | None:
    if not text or text == "None":
        return None
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) else None
