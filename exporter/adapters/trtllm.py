"""TensorRT-LLM `trtllm-serve`, its /prometheus/metrics page (NVIDIA/TensorRT-LLM
tensorrt_llm/metrics/collector.py; the page exists only with `return_perf_metrics: true`, the KV and
queue gauges only with `enable_iter_perf_stats: true` as well).

Three spellings of the same names: unprefixed (1.1 to 1.3.0rc4: only the five request
families, labels `engine_type`/`model_name` fixed at "undefined"), `trtllm:` (as Dynamo 0.7
re-exported them) and `trtllm_` (1.3.0rc5 on). There is no preemption counter (paused requests are
a gauge of a different thing), so `preemptions_total` stays absent. The iteration gauges are
refreshed when a request finishes, so on an idle or stuck server they keep their last values.
"""

from __future__ import annotations

from .base import NO_KV_TRANSFER, NO_POOL_DETAIL, Adapter, Samples, Series
from ..snapshot import Snapshot

PREFIX = "trtllm_"
# Re-exporters' spelling (Dynamo 0.7) and the unprefixed names before 1.3.0rc5.
_OLDER_PREFIXES = ("trtllm:", "")
# Before #12545 both constructor labels were hard-coded to this.
_UNSET = "undefined"


class TrtllmAdapter(Adapter):
    engine = "trtllm"
    title = "TensorRT-LLM"
    # The unprefixed generation has generic names: only a multiprocess page's sorted labels, which
    # start with the hard-coded `engine_type`, tell it apart from other servers' request histograms.
    marker = (r"trtllm[:_]|(?:request_success_total|(?:e2e_request_latency|time_to_first_token"
              r"|time_per_output_token|request_queue_time)_seconds_(?:bucket|count|sum))\{engine_type=")
    rank_label = None  # one KV pool per server; attention-DP ranks are not labelled
    # Dynamo's TensorRT-LLM worker labels its own series with its role.
    role_label = ("disaggregation_mode", {"prefill": "prefill", "decode": "decode", "prefill_and_decode": "unified"})
    # No preemption counter (paused requests are a gauge, read as such): never `thrashing`. Dynamo's KV transfer
    # series have no failure, lease or stage counterpart; trtllm-serve itself exports no transfer series.
    not_reported = NO_POOL_DETAIL | (NO_KV_TRANSFER - {"kv_transfer_seconds", "kv_transfer_bytes",
                                                       "kv_transfer_speed_bytes_per_second",
                                                       "kv_transfer_above_link_total"})
    extra_names = ("trtllm_kv_cache_config_info",)
    series = (
        Series("usage_ratio", ("trtllm_kv_cache_utilization",)),
        Series("capacity_blocks", ("trtllm_kv_cache_max_blocks",)),
        Series("used_blocks", ("trtllm_kv_cache_used_blocks",)),
        Series("block_size_tokens", ("trtllm_kv_cache_tokens_per_block",)),
        Series("requests_running", ("trtllm_num_requests_running",)),
        Series("requests_running_max", ("trtllm_max_num_active_requests",)),
        Series("requests_waiting", ("trtllm_num_requests_waiting",)),
        Series("requests_paused", ("trtllm_num_paused_requests",)),
        Series("prefix_cache_queried_tokens_total", ("trtllm_prompt_tokens_total",), "counter"),
        Series("prefix_cache_hit_tokens_total", ("trtllm_prompt_cached_tokens_total",), "counter"),
        Series("prompt_tokens_total", ("trtllm_prompt_tokens_total",), "counter"),
        Series("generation_tokens_total", ("trtllm_generation_tokens_total",), "counter"),
        Series("requests_finished_total", ("trtllm_request_success_total",), "counter", sum_over=("finished_reason",)),
        Series("time_to_first_token_seconds", ("trtllm_time_to_first_token_seconds",), "histogram"),
        # One observation per request (its mean time per output token), not one per token.
        Series("inter_token_latency_seconds", ("trtllm_time_per_output_token_seconds",), "histogram"),
        Series("queue_time_seconds", ("trtllm_request_queue_time_seconds",), "histogram"),
        Series("e2e_request_latency_seconds", ("trtllm_e2e_request_latency_seconds",), "histogram"),
        # Dynamo's additions for disaggregated TensorRT-LLM (components/src/dynamo/trtllm, prometheus_names.rs
        # trtllm_additional): AdditionalMetricsCollector.record_kv_transfer_perf observes them on the decode side,
        # per request, from TRT-LLM's timing metrics (kv_cache_transfer_start to _end, kv_cache_size); the speed
        # is bytes / (seconds x 1e9), GB/s.
        Series("kv_transfer_seconds", ("trtllm_kv_transfer_latency_seconds",), "histogram"),
        Series("kv_transfer_bytes", ("trtllm_kv_transfer_bytes",), "histogram"),
        Series("kv_transfer_speed_bytes_per_second", ("trtllm_kv_transfer_speed_gb_s",), "histogram", scale=1e9),
    )

    def variants_of(self, names: tuple[str, ...]) -> list[str]:
        out = []
        for name in names:
            tail = name.removeprefix(PREFIX)
            out.extend((name, *(prefix + tail for prefix in _OLDER_PREFIXES)))
        return out

    def model_of(self, samples: Samples) -> str:
        model = super().model_of(samples)
        return "" if model == _UNSET else model

    def complete(self, samples: Samples, snapshot: Snapshot) -> None:
        """Block size from `kv_cache_config_info{page_size}` where the gauge is missing."""
        name = self.first_present(self.extra_names, samples)
        for sample in samples.get(name, ()) if name else ():
            page_size = sample.labels.get("page_size", "")
            if page_size.isascii() and page_size.isdigit() and int(page_size) > 0:
                for rank in snapshot.ranks.values():
                    rank.gauges.setdefault("block_size_tokens", float(page_size))
