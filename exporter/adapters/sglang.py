"""SGLang 0.3.6 to 0.5.x: wire names across versions (reference §3)."""

from __future__ import annotations

from .base import NO_RUNNING_CAP, Adapter, Samples, Series
from ..snapshot import Snapshot

# Tokenizer-side series split by `is_streaming` (0.5.19+); the slices add up to the total.
_STREAMING = ("is_streaming",)
# Present from 0.5.10 on, when `num_retracted_requests_total` exists but is only created at the first retraction.
_RETRACTION_COUNTER_ERA = ("sglang:full_token_usage", "sglang:kv_used_tokens")
# The storage tier (L3, --hicache-storage-backend) by backend: the local file backend is disk, the
# distributed stores are remote; others (shm, sim, custom) have no tier. The storage collector labels its
# series with the CLI name (`storage_backend`); cached_tokens_total named the backend's class up to 0.5.2x
# (`storage_<class>`), then the literal `storage` (0.5.23), resolved from the page's `storage_backend`.
_STORAGE_TIERS = {"file": "disk", "mooncake": "remote", "hf3fs": "remote", "nixl": "remote", "aibrix": "remote",
                  "eic": "remote", "simm": "remote", "mori": "remote"}
_STORAGE_CLASSES = {"file": "HiCacheFile", "mooncake": "MooncakeStore", "hf3fs": "HiCacheHF3FS",
                    "nixl": "HiCacheNixl", "aibrix": "AibrixKVCacheStorage", "eic": "EICStorage",
                    "simm": "HiCacheSiMM", "mori": "UMBPStore"}
_STORAGE_SOURCE = "storage"  # 0.5.23's cache_source for any backend
# cached_tokens_total{cache_source}: `total` (no breakdown) is no source.
_HIT_SOURCES = {"total": None, "device": "gpu", "host": "cpu", _STORAGE_SOURCE: _STORAGE_SOURCE,
                **{f"storage_{cls}": _STORAGE_TIERS[name] for name, cls in _STORAGE_CLASSES.items()}}
# HiCache counters split by `pool` (kv, swa, mamba; absent before it existed); mamba counts state slots.
_KV_POOL = {"pool": ("kv", "")}
# Per-rank byte counters: each TP (and PP) rank moves its own shard of the KV, so the rank total is the sum.
_SHARDS = ("tp_rank", "pp_rank")
# Host tier (L2) transfers: (direction, tokens, bytes, duration histogram). Backup is GPU to host memory; not
# `evicted_tokens_total`, which counts GPU slots freed, backed up or not.
_HOST_TRANSFERS = (("load", "sglang:load_back_tokens_total", "sglang:load_back_bytes_total",
                    "sglang:load_back_duration_seconds_sum"),
                   ("store", "sglang:hicache_backup_tokens_total", "sglang:hicache_backup_bytes_total",
                    "sglang:hicache_backup_duration_seconds_sum"))
_TRANSFERS = tuple(
    series
    for direction, tokens, nbytes, seconds in _HOST_TRANSFERS
    for series in (Series("tier_transfer_tokens_total", (tokens,), "counter", match=_KV_POOL,
                          labels=("cpu", direction)),
                   Series("tier_transfer_bytes_total", (nbytes,), "counter", sum_over=_SHARDS,
                          labels=("cpu", direction)),
                   Series("tier_transfer_seconds_total", (seconds,), "counter", labels=("cpu", direction)))
) + tuple(
    # Storage tier (L3): prefetch is storage to host memory (the first hop of a load), backup host to storage.
    Series("tier_transfer_tokens_total", (name,), "counter",
           match={"storage_backend": tuple(b for b, t in _STORAGE_TIERS.items() if t == tier)},
           labels=(tier, direction))
    for direction, name in (("load", "sglang:prefetched_tokens_total"), ("store", "sglang:backuped_tokens_total"))
    for tier in sorted(set(_STORAGE_TIERS.values())))
_STORAGE_NAMES = ("sglang:prefetched_tokens_total", "sglang:backuped_tokens_total")
# Disaggregation (--disaggregation-mode; names from observability/metrics_collector.py). Every scheduler
# exports every queue gauge, its role's and the other role's at 0 (a unified one all of them): each is read
# only on the role it belongs to. SchedulerMetricsMixin.log_prefill_stats / log_decode_stats fill them from the
# role's queues (disaggregation/prefill.py, disaggregation/decode.py).
_PREFILL, _DECODE = {"engine_type": "prefill"}, {"engine_type": "decode"}
_KV_TRANSFER = (
    # Observed on the prefill side (the sender), per request; bytes in MiB (2**20), latency in ms.
    Series("kv_transfer_seconds", ("sglang:kv_transfer_latency_ms",), "histogram", scale=0.001),
    Series("kv_transfer_bytes", ("sglang:kv_transfer_total_mb",), "histogram", scale=2**20),
    # SchedulerReqTimeStats.compute_and_observe_kv_transfer_metrics: MiB / 1024 over seconds, i.e. GiB/s.
    Series("kv_transfer_speed_bytes_per_second", ("sglang:kv_transfer_speed_gb_s",), "histogram", scale=2**30),
    # Created at their first failure. Both sides count a failed transfer: the sender, which times it, when its
    # inflight queue polls it failed (prefill.py), the receiver when its transfer queue does (decode.py): the
    # decode side's are its receives given up, as vLLM Mooncake's.
    Series("kv_transfer_failures_total", ("sglang:num_transfer_failed_reqs_total",), "counter",
           match={"engine_type": ("prefill", "unified", "")}, labels=("transfer",)),
    Series("kv_transfer_failures_total", ("sglang:num_transfer_failed_reqs_total",), "counter", match=_DECODE,
           labels=("receive",)),
    Series("kv_transfer_failures_total", ("sglang:num_bootstrap_failed_reqs_total",), "counter",
           labels=("handshake",)),
    # Decode: DecodePreallocQueue (the handshake, then KV pre-allocated once the pool has room), then
    # DecodeTransferQueue (receiving), then the scheduler's waiting queue (received, its turn to run not come:
    # `num_queue_reqs` on a decode server).
    Series("kv_transfer_requests", ("sglang:num_decode_prealloc_queue_reqs",), match=_DECODE,
           labels=("waiting_to_start",)),
    Series("kv_transfer_requests", ("sglang:num_decode_transfer_queue_reqs",), match=_DECODE, labels=("in_progress",)),
    Series("kv_transfer_requests", ("sglang:num_queue_reqs",), match=_DECODE, labels=("completed_waiting",)),
    # Prefill: PrefillBootstrapQueue (waiting for the decode side to allocate the KV, `prealloc` in its first
    # name), then the waiting queue and the running batch, then the inflight queue (computed, KV being sent).
    Series("kv_transfer_requests", ("sglang:num_prefill_bootstrap_queue_reqs", "sglang:num_prefill_prealloc_queue_reqs"),
           match=_PREFILL, labels=("waiting_to_start",)),
    Series("kv_transfer_requests", ("sglang:num_prefill_inflight_queue_reqs",), match=_PREFILL,
           labels=("in_progress",)),
)


class SglangAdapter(Adapter):
    engine = "sglang"
    title = "SGLang"
    marker = r"sglang[:_]"
    prefix_aliases = ("sglang_",)
    rank_label = "dp_rank"
    role_label = ("engine_type", {"prefill": "prefill", "decode": "decode", "unified": "unified"})
    export_hold = "inflight"
    # No lease: a decode pool pre-allocates before the prefill side computes.
    not_reported = NO_RUNNING_CAP | frozenset({
        "requests_waiting_for_capacity", "requests_paused", "tier_used_bytes", "tier_store_failures_total",
        "tier_evictions_total", "external_cache_queried_tokens_total", "external_cache_hit_tokens_total",
        "kv_transfer_lease_expiries_total", "kv_transfer_notifications_after_expiry_total",
        "kv_transfer_prompt_tokens_total"})
    # With priority scheduling, priority="" is the total and other values are slices of it.
    base_match = {"priority": ""}
    extra_names = ("sglang:cache_config_info",) + _STORAGE_NAMES
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
        # The tokenizer's observe_one_finished_request: one per finished request, next to its prompt tokens and e2e
        # latency.
        Series("requests_finished_total", ("sglang:num_requests_total",), "counter", sum_over=_STREAMING),
        Series("cached_prompt_tokens_total", ("sglang:cached_tokens_total",), "counter", sum_over=_STREAMING,
               label_from=("cache_source", _HIT_SOURCES)),
        # HiCache (--enable-hierarchical-cache): the host-memory tier, and the storage tier behind it.
        Series("tier_capacity_tokens", ("sglang:hicache_host_total_tokens",), labels=("cpu",)),
        Series("tier_used_tokens", ("sglang:hicache_host_used_tokens",), labels=("cpu",)),
        *_TRANSFERS,
        Series("generation_tokens_total", ("sglang:generation_tokens_total",), "counter", sum_over=_STREAMING),
        Series("time_to_first_token_seconds", ("sglang:time_to_first_token_seconds",), "histogram",
               sum_over=_STREAMING),
        Series("inter_token_latency_seconds",
               ("sglang:inter_token_latency_seconds", "sglang:time_per_output_token_seconds"), "histogram",
               sum_over=_STREAMING),
        Series("queue_time_seconds", ("sglang:queue_time_seconds",), "histogram"),
        Series("e2e_request_latency_seconds", ("sglang:e2e_request_latency_seconds",), "histogram",
               sum_over=_STREAMING),
        *_KV_TRANSFER,
    )

    def complete(self, samples: Samples, snapshot: Snapshot) -> None:
        for rank in snapshot.ranks.values():
            # A decode server's queue is its three P/D queues (num_queue_reqs holds only the last), as vLLM's
            # waiting queue holds a decode request from its arrival until it runs.
            stages = rank.labelled.get("kv_transfer_requests", {}) if snapshot.role == "decode" else {}
            if stages:
                rank.gauges["requests_waiting"] = sum(stages.values())
            # `max_total_num_tokens` reads 0 before the first report (0.5.6, 0.5.10): unknown, not empty.
            if rank.gauges.get("capacity_tokens") == 0:
                del rank.gauges["capacity_tokens"]
            # 0.5.23's cache_source="storage": the tier of the backend the storage collector names.
            hits = rank.labelled.get("cached_prompt_tokens_total", {})
            if (_STORAGE_SOURCE,) in hits:
                tier = (self._storage_tier(samples),)
                hits[tier] = hits.get(tier, 0.0) + hits.pop((_STORAGE_SOURCE,))
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

    def _storage_tier(self, samples: Samples) -> str:
        name = self.first_present(_STORAGE_NAMES, samples)
        for sample in samples.get(name, ()) if name else ():
            return _STORAGE_TIERS.get(sample.labels.get("storage_backend", ""), "other")
        return "other"
