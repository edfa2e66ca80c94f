"""SGLang 0.3.6 to 0.5.x: wire names across versions (reference §3)."""

from __future__ import annotations

from .base import Adapter, Samples, Series
from ..snapshot import Snapshot

# Tokenizer-side series split by `is_streaming` (0.5.19+); the slices add up to the total.
_STREAMING = ("is_streaming",)
# Present from 0.5.10 on, when `num_retracted_requests_total` exists but is only created at the first retraction.
_RETRACTION_COUNTER_ERA = ("sglang:full_token_usage", "sglang:kv_used_tokens")
# cached_tokens_total{cache_source}: `total` (no breakdown) is no source. Storage backends (L3) other than
# the local file backend are remote.
_HIT_SOURCES = {"total": None, "device": "gpu", "host": "cpu", "storage_file": "disk", "storage_mooncake": "remote",
                "storage_hf3fs": "remote", "storage_nixl": "remote", "storage_aibrix": "remote",
                "storage_eic": "remote"}
# Newer HiCache counters split by `pool` (kv, mamba); mamba counts state slots, not tokens.
_KV_POOL = {"pool": ("kv", "")}


class SglangAdapter(Adapter):
    engine = "sglang"
    title = "SGLang"
    marker = r"sglang[:_]"
    prefix_aliases = ("sglang_",)
    rank_label = "dp_rank"
    not_reported = frozenset({"requests_waiting_for_capacity", "requests_paused", "tier_used_bytes",
                              "tier_transfer_bytes_total", "tier_store_failures_total",
                              "external_cache_queried_tokens_total", "external_cache_hit_tokens_total"})
    # With priority scheduling, priority="" is the total and other values are slices of it.
    base_match = {"priority": ""}
    extra_names = ("sglang:cache_config_info",)
    series = (
        Series("usage_ratio", ("sglang:token_usage",)),
        Series("capacity_tokens", ("sglang:max_total_num_tokens",)),
        Series("capacity_blocks", ("sglang:num_pages",)),
        Series("block_size_tokens", ("sglang:page_size",)),
        Series("used_tokens", ("sglang:kv_used_tokens", "sglang:num_used_tokens")),
        Series("evictable_tokens", ("sglang:kv_evictable_tokens",)),
        Series("requests_running", ("sglang:num_running_reqs",)),
        Series("requests_waiting", ("sglang:num_queue_reqs",)),
        # Not `num_retracted_reqs`: that gauge holds only the last report interval (reference §6.7).
        Series("preemptions_total", ("sglang:num_retracted_requests_total", "sglang:total_retracted_reqs"), "counter",
               zero_when_present=_RETRACTION_COUNTER_ERA),
        Series("prefix_cache_queried_tokens_total", ("sglang:prompt_tokens_total",), "counter", sum_over=_STREAMING),
        Series("prefix_cache_hit_tokens_total", ("sglang:cached_tokens_total",), "counter",
               sum_over=("cache_source",) + _STREAMING),
        Series("prompt_tokens_total", ("sglang:prompt_tokens_total",), "counter", sum_over=_STREAMING),
        Series("cached_prompt_tokens_total", ("sglang:cached_tokens_total",), "counter", sum_over=_STREAMING,
               label_from=("cache_source", _HIT_SOURCES)),
        # HiCache (--enable-hierarchical-cache): the host-memory tier.
        Series("tier_capacity_tokens", ("sglang:hicache_host_total_tokens",), labels=("cpu",)),
        Series("tier_used_tokens", ("sglang:hicache_host_used_tokens",), labels=("cpu",)),
        Series("tier_transfer_tokens_total", ("sglang:load_back_tokens_total",), "counter", match=_KV_POOL,
               labels=("cpu", "load")),
        Series("tier_transfer_tokens_total", ("sglang:evicted_tokens_total",), "counter", match=_KV_POOL,
               labels=("cpu", "store")),
        Series("tier_transfer_seconds_total", ("sglang:load_back_duration_seconds_sum",), "counter",
               match=_KV_POOL, labels=("cpu", "load")),
        Series("tier_transfer_seconds_total", ("sglang:eviction_duration_seconds_sum",), "counter",
               match=_KV_POOL, labels=("cpu", "store")),
        Series("generation_tokens_total", ("sglang:generation_tokens_total",), "counter", sum_over=_STREAMING),
        Series("time_to_first_token_seconds", ("sglang:time_to_first_token_seconds",), "histogram",
               sum_over=_STREAMING),
        Series("inter_token_latency_seconds",
               ("sglang:inter_token_latency_seconds", "sglang:time_per_output_token_seconds"), "histogram",
               sum_over=_STREAMING),
        Series("queue_time_seconds", ("sglang:queue_time_seconds",), "histogram"),
        Series("e2e_request_latency_seconds", ("sglang:e2e_request_latency_seconds",), "histogram",
               sum_over=_STREAMING),
    )

    def complete(self, samples: Samples, snapshot: Snapshot) -> None:
        for rank in snapshot.ranks.values():
            # `max_total_num_tokens` reads 0 before the first report (0.5.6, 0.5.10): unknown, not empty.
            if rank.gauges.get("capacity_tokens") == 0:
                del rank.gauges["capacity_tokens"]
        # 0.5.10 alone carried page size and page count as info labels.
        name = self.first_present(("sglang:cache_config_info",), samples)
        for sample in samples.get(name, ()) if name else ():
            rank = snapshot.ranks.get(self.rank_of(sample.labels))
            if rank is None:
                continue
            for concept, label in (("capacity_blocks", "num_pages"), ("block_size_tokens", "page_size")):
                value = sample.labels.get(label, "")
                if concept not in rank.gauges and value.isascii() and value.isdigit():
                    rank.gauges[concept] = float(value)
