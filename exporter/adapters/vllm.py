"""vLLM V0 and V1: wire names across versions (reference §2)."""

from __future__ import annotations

import math

from .base import Adapter, Samples, Series
from ..snapshot import RankValues, Snapshot

# Bucketed `priority` slices (with --scheduling-policy priority) partition the requests: sum them.
_REQUEST_SLICES = ("priority",)


class VllmAdapter(Adapter):
    engine = "vllm"
    title = "vLLM"
    marker = r"vllm[:_]"
    prefix_aliases = ("vllm_",)
    rank_label = "engine"  # V1's data-parallel engine index; V0 has none
    not_reported = frozenset({"evictable_tokens", "requests_paused"})
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
        """Per-engine capacity from `cache_config_info` labels.

        With data parallelism vLLM's frontend adds up `num_gpu_blocks` over the engines it started
        (vllm/v1/engine/core_client.py, "Sum num_gpu_blocks from all engines in DP case"; before that
        vllm/v1/engine/utils.py at the startup handshake) and then writes that one config, sum included,
        into the series of every engine. So each engine's pool is the sum over the engines on the page;
        the even split is exact for alike engines (the usual DP setup) and a guess when their GPUs or
        memory differ, which the page cannot show. One block per engine is the null block. Newer vLLM
        (#42206) also writes `kv_cache_size_tokens`, which it does not add up (the first engine's
        value), counted from the same blocks as the engine's pool, null block included.
        """
        name = self.first_present(("vllm:cache_config_info",), samples)
        infos = samples.get(name, ()) if name else ()
        engines = max(1, len({sample.labels["engine"] for sample in infos if "engine" in sample.labels}))
        for sample in infos:
            labels = sample.labels
            # Before the `engine` label (#15755) one info series described every engine alike.
            ranks = [labels["engine"]] if "engine" in labels else list(snapshot.ranks) or ["0"]
            values = {}
            summed = _number(labels.get("num_gpu_blocks"))
            engine_blocks = summed // engines if summed is not None else None
            if engine_blocks is not None and engine_blocks > 1:
                values["capacity_blocks"] = engine_blocks - 1
            block_size = _number(labels.get("block_size"))
            if block_size:
                values["block_size_tokens"] = block_size
            # Group-aware token capacity (hybrid models) where the engine states it (#42206), less the
            # null block's share of it.
            tokens = _number(labels.get("kv_cache_size_tokens"))
            if tokens and "capacity_blocks" in values:
                values["capacity_tokens"] = float(math.floor(tokens - tokens / engine_blocks))
            elif tokens:
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
