"""vLLM V0 and V1: wire names across versions (reference §2)."""

from __future__ import annotations

import math

from . import lmcache
from .base import NO_RUNNING_CAP, Adapter, Samples, Series
from ..contract import TRANSFER_STAGES
from ..snapshot import RankValues, Snapshot

# Bucketed `priority` slices (with --scheduling-policy priority) partition the requests: sum them.
_REQUEST_SLICES = ("priority",)
# prompt_tokens_cached_by_source_total{source} (vllm/v1/metrics/cache_hit_source.py): `p2p` is KV from
# another instance; `external_unspecified` a connector that does not say where its hit came from.
_HIT_SOURCES = {"device": "gpu", "host": "cpu", "cpu": "cpu", "disk": "disk", "p2p": "peer"}
# The disaggregated-serving connectors (--kv-transfer-config): NIXL (0.11.1+), then Mooncake (0.33+), the same
# shapes (nixl/stats.py, mooncake/stats.py); the first one on the page wins.
_CONNECTORS = ("nixl", "mooncake")


def _connector(name: str) -> tuple[str, ...]:
    return tuple(f"vllm:{connector}_{name}" for connector in _CONNECTORS)


_KV_TRANSFER = (
    # One observation per TP rank's transfer, timed by the side that drives it: the reader (decode) under
    # NixlConnector, the writer (prefill) under NixlPushConnector and MooncakeConnector.
    Series("kv_transfer_seconds", _connector("xfer_time_seconds"), "histogram"),
    Series("kv_transfer_bytes", _connector("bytes_transferred"), "histogram"),
    # Since 0.31 NIXL's failed transfers include its handshake and notification failures.
    Series("kv_transfer_failures_total", _connector("num_failed_transfers_total"), "counter", labels=("transfer",)),
    Series("kv_transfer_failures_total", ("vllm:nixl_num_failed_notifications_total",), "counter",
           labels=("notification",)),
    # Mooncake's decode worker gives up on a load (record_failed_recv): the writer, on the prefill side, may count
    # the same transfer as failed, and the decode side times none to judge a ratio by.
    Series("kv_transfer_failures_total", ("vllm:mooncake_num_failed_recvs_total",), "counter", labels=("receive",)),
    Series("kv_transfer_lease_expiries_total", _connector("num_kv_expired_reqs_total"), "counter"),
    Series("kv_transfer_notifications_after_expiry_total", ("vllm:nixl_num_notifications_after_expiry_total",),
           "counter"),
    # Registered only on a KV consumer (decode, or kv_both); Scheduler._set_kv_fetch_stage keeps the counts:
    # waiting_to_start from the request's arrival (do_remote_prefill) until its blocks are allocated,
    # in_progress from then (WAITING_FOR_REMOTE_KVS) until the connector reports it received,
    # completed_waiting from then (_update_from_kv_xfer_finished) until it is scheduled.
    Series("kv_transfer_requests", ("vllm:num_requests_kv_fetch_by_stage",), label_from=(
        "stage", {stage: stage for stage in TRANSFER_STAGES})),
)
# Prompt tokens whose KV a connector supplied, counted when the request's first token comes out
# (PromptTokenStats.update_from_output, from the PrefillStats of its admission): a peer's where a P/D connector
# runs. Not `prompt_tokens_cached_by_source_total{source="p2p"}`: that counts the hits a load was planned for,
# at admission (Scheduler.schedule -> connector_prefix_cache_stats.record), failed and unfinished loads included.
_EXTERNAL_PROMPT_TOKENS = "vllm:prompt_tokens_by_source_total"
# The native offload tier (OffloadingConnector, CPU spec): flat names first (#35669), then the deprecated
# `transfer_type` trio (#27942) that older versions have alone.
_TRANSFERS = tuple(
    Series(concept, names, "counter", match=match, labels=("cpu", direction))
    for direction, wire, transfer_type in (("load", "load", "CPU_to_GPU"), ("store", "store", "GPU_to_CPU"))
    for concept, quantity in (("tier_transfer_bytes_total", "bytes"), ("tier_transfer_seconds_total", "time"))
    for names, match in (((f"vllm:kv_offload_{wire}_{quantity}_total",), {}),
                         ((f"vllm:kv_offload_total_{quantity}_total",), {"transfer_type": transfer_type})))


class VllmAdapter(Adapter):
    engine = "vllm"
    title = "vLLM"
    marker = r"vllm[:_]"
    prefix_aliases = ("vllm_",)
    rank_label = "engine"  # V1's data-parallel engine index; V0 has none
    export_hold = "finished"
    # NIXL and Mooncake time and size each transfer in two histograms: no speed of one transfer.
    not_reported = frozenset({"evictable_tokens", "requests_paused", "tier_transfer_tokens_total",
                              "kv_transfer_speed_bytes_per_second", "kv_transfer_above_link_total"}) | NO_RUNNING_CAP
    extra_names = ("vllm:cache_config_info", "vllm:kv_offload_config_info", _EXTERNAL_PROMPT_TOKENS)
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
        # PrometheusStatLogger.record: one per finished request, by its finish reason, next to its e2e latency.
        Series("requests_finished_total", ("vllm:request_success_total",), "counter", sum_over=("finished_reason",)),
        Series("generation_tokens_total", ("vllm:generation_tokens_total",), "counter"),
        # vLLM's connector counters, else LMCache's lookup counters (with PROMETHEUS_MULTIPROC_DIR).
        Series("external_cache_queried_tokens_total",
               ("vllm:external_prefix_cache_queries_total", lmcache.LOOKUP_TOKENS), "counter"),
        Series("external_cache_hit_tokens_total",
               ("vllm:external_prefix_cache_hits_total", lmcache.LOOKUP_HITS), "counter"),
        Series("cached_prompt_tokens_total", ("vllm:prompt_tokens_cached_by_source_total",), "counter",
               label_from=("source", _HIT_SOURCES)),
        Series("tier_usage_ratio", ("vllm:kv_offload_cpu_cache_usage_perc",), labels=("cpu",)),
        Series("tier_store_failures_total", ("vllm:kv_offload_allocation_failure_total",), "counter",
               labels=("cpu",)),
        *_TRANSFERS,
        *lmcache.TIER_SERIES,
        *_KV_TRANSFER,
        Series("time_to_first_token_seconds", ("vllm:time_to_first_token_seconds",), "histogram",
               sum_over=_REQUEST_SLICES),
        Series("inter_token_latency_seconds",
               ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"), "histogram"),
        Series("queue_time_seconds", ("vllm:request_queue_time_seconds",), "histogram", sum_over=_REQUEST_SLICES),
        Series("e2e_request_latency_seconds", ("vllm:e2e_request_latency_seconds",), "histogram",
               sum_over=_REQUEST_SLICES),
    )

    def complete(self, samples: Samples, snapshot: Snapshot) -> None:
        self._capacity(samples, snapshot)
        self._received_prompt_tokens(samples, snapshot)

    def _received_prompt_tokens(self, samples: Samples, snapshot: Snapshot) -> None:
        """The prompt tokens a P/D connector supplied (`external_kv_transfer`) where the page has a P/D
        connector's series."""
        connector = any(self.first_present(_connector(name), samples, "_count")
                        for name in ("xfer_time_seconds", "bytes_transferred"))
        name = self.first_present((_EXTERNAL_PROMPT_TOKENS,), samples)
        if not connector or name is None:
            return
        for sample in samples[name]:
            if sample.labels.get("source") == "external_kv_transfer" and math.isfinite(sample.value):
                counters = snapshot.ranks.setdefault(self.rank_of(sample.labels), RankValues()).counters
                counters["kv_transfer_prompt_tokens_total"] = sample.value

    def _capacity(self, samples: Samples, snapshot: Snapshot) -> None:
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
            # Where hits land (vllm/v1/core/kv_cache_utils.py, resolve_cache_hit_alignment_tokens): the page's
            # alignment where it states one, else the full-attention block of a hybrid model, which vLLM grows
            # to match the Mamba or sliding-window page (1,920 to 4,096 tokens) while block_size stays small.
            min_hit = next((value for value in map(_number, (labels.get("cache_hit_alignment_tokens"),
                                                             labels.get("effective_attention_block_size")))
                            if value), block_size)
            if min_hit:
                values["prefix_cache_min_hit_tokens"] = min_hit
            # Group-aware token capacity (hybrid models) where the engine states it (#42206), less the
            # null block's share of it.
            tokens = _number(labels.get("kv_cache_size_tokens"))
            if tokens and "capacity_blocks" in values:
                values["capacity_tokens"] = float(math.floor(tokens - tokens / engine_blocks))
            elif tokens:
                values["capacity_tokens"] = tokens
            for rank in ranks:
                snapshot.ranks.setdefault(rank, RankValues()).gauges.update(values)
        # The CPU offload tier's size, per engine (each engine reports its own, not the instance total).
        name = self.first_present(("vllm:kv_offload_config_info",), samples)
        for sample in samples.get(name, ()) if name else ():
            tokens = _number(sample.labels.get("cpu_kv_cache_size_tokens"))
            if tokens is not None:
                rank = snapshot.ranks.setdefault(self.rank_of(sample.labels), RankValues())
                rank.labelled.setdefault("tier_capacity_tokens", {})[("cpu",)] = tokens


def _number(text: str | None) -> float | None:
    if not text or text == "None":
        return None
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) else None
