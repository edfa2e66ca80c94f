"""Render simulated engine state in the exact /metrics shape of the engine imitated.

One custom prometheus_client Collector per flavor reads the latest published `EngineState`, so
`_created`, sample order and label sets can differ per flavor inside one process:

- `vllm-v1`: vLLM >= 0.11 (a 2026 build: with `num_requests_waiting_by_reason`), one API
  server, single-process client: `_created` on every counter and histogram child, labels
  `engine` (the DP index) and `model_name`, histogram samples buckets, `_count`, `_sum`.
  `num_preemptions_total` counts a preemption when the request is scheduled again; queue time
  is observed when a request finishes. `python_*` families as in any single-process client
  (`process_*` left out: it would not follow simulated restarts).
  With DP, `cache_config_info` carries `num_gpu_blocks` summed over the engines in every engine's
  series, as vLLM's frontend writes it.
- `vllm-v1-kv-tokens`: `vllm-v1` after vLLM #42206: `cache_config_info` also carries
  `kv_cache_size_tokens` and `kv_cache_max_concurrency` (the first engine's, not summed).
- `vllm-v0`: the legacy names (`gpu_cache_usage_perc`, `gpu_prefix_cache_*`,
  `time_per_output_token_seconds`), `model_name` only, no `_created` (V0 disabled it), TTFT
  buckets up to 10 s, `cache_config_info` as an Info without `engine`. Prefix counters are in
  tokens (builds before vLLM #18003 counted blocks). No data parallelism.
- `sglang`: SGLang 0.5.19-era, multiprocess client: no `_created`, HELP "Multiprocess metric",
  histogram `_sum` before its buckets and `_count` last, children in a different order on every
  scrape. Scheduler gauges carry `engine_type, model_name, moe_ep_rank, pp_rank, tp_rank`
  (+ `dp_rank` with dp > 1) and refresh as SGLang's do (prefill batches, every 40 decode steps,
  30 s idle); every TP rank repeats them (`--enable-metrics-for-all-schedulers`), and the
  per-rank counters and `queue_time_seconds` too. Tokenizer-side metrics carry
  `engine_type, model_name` (+ `is_streaming="true"` on TTFT, e2e and the token counters),
  are summed over DP ranks and appear on first use, like `num_retracted_requests_total`.
- With an offload tier (`offload_blocks`): `vllm-v1` and `vllm-v1-kv-tokens` add vLLM 0.33's native CPU
  offload families (`kv_offload_*`, `kv_offload_config_info`), `external_prefix_cache_*` and
  `prompt_tokens_cached_by_source_total{source="device"|"host"}`; `sglang` adds HiCache's
  `hicache_host_{total,used}_tokens`, 0.5.23's `load_back_{tokens,bytes}_total` and
  `hicache_backup_{tokens,bytes}_total` with the radix cache's labels, the load-back and backup duration
  histograms (both in load-back's buckets), and `cached_tokens_total{cache_source="host"}`. vLLM V0 and TensorRT-LLM
  show no tier.
- `trtllm`: TensorRT-LLM `trtllm-serve`'s /prometheus/metrics in the `trtllm_` generation (1.3.0rc5 on,
  with #12545's labels `engine_type="pytorch"` and the served `model_name`, and #12636's
  `prompt_cached_tokens_total`; names of tensorrt_llm/metrics/collector.py). Multiprocess client: no
  `_created`, gauges carry `pid`, histogram `_sum` first. Iteration gauges refresh only when a request
  finishes (never while idle); token counters and histograms are per finished request. No preemption
  counter. The simulator's per-token ITL observations stand in for TRT-LLM's per-request TPOT. No DP.
"""

from __future__ import annotations

import math
import os
import random
import threading
from dataclasses import dataclass, replace
from typing import Callable, Iterable, Iterator

from prometheus_client.core import InfoMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from .model import HistogramBuckets, Histogram, ModelSnapshot, Reporting

VLLM_REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                                40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
VLLM_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                     5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
VLLM_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0)
VLLM_ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)

VLLM_V1_BUCKETS = HistogramBuckets(
    ttft=VLLM_TTFT_BUCKETS, itl=VLLM_ITL_BUCKETS, e2e=VLLM_REQUEST_LATENCY_BUCKETS,
    queue=VLLM_REQUEST_LATENCY_BUCKETS, iteration_tokens=VLLM_ITERATION_TOKEN_BUCKETS)
# Before vLLM #15202 the TTFT buckets stopped at 10 s.
VLLM_V0_BUCKETS = HistogramBuckets(
    ttft=VLLM_TTFT_BUCKETS[:VLLM_TTFT_BUCKETS.index(10.0) + 1], itl=VLLM_ITL_BUCKETS,
    e2e=VLLM_REQUEST_LATENCY_BUCKETS, queue=VLLM_REQUEST_LATENCY_BUCKETS,
    iteration_tokens=VLLM_ITERATION_TOKEN_BUCKETS)
# hiradix's load-back and eviction duration buckets (SGLang's metrics collector).
SGLANG_OFFLOAD_BUCKETS = (0.001, 0.002, 0.003, 0.004, 0.005, 0.006, 0.007, 0.008, 0.009, 0.01, 0.02, 0.03, 0.04,
                          0.05, 0.1, 0.2, 0.5, 1.0)
SGLANG_BUCKETS = HistogramBuckets(
    ttft=(0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400),
    itl=(0.002, 0.004, 0.006, 0.008, 0.010, 0.015, 0.020, 0.025, 0.030, 0.035, 0.040, 0.060,
         0.080, 0.100, 0.200, 0.400, 0.600, 0.800, 1.000, 2.000, 4.000, 6.000, 8.000),
    e2e=(0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400, 600, 1200,
         1800, 2400),
    queue=(0.0, 0.1, 0.2, 0.5, 1, 2, 3, 4, 5, 10, 15, 20, 30, 40, 50, 60, 70, 80, 90, 100, 200,
           300, 400, 500, 600, 700, 800, 900, 1000, 1200, 1400, 1600, 1800, 2000, 2500, 3000),
    offload_transfer=SGLANG_OFFLOAD_BUCKETS,
)

SGLANG_DECODE_LOG_INTERVAL = 40
# collector.py's defaults are vLLM's: TTFT, TPOT (= vLLM's ITL buckets), e2e and queue time.
TRTLLM_BUCKETS = HistogramBuckets(ttft=VLLM_TTFT_BUCKETS, itl=VLLM_ITL_BUCKETS, e2e=VLLM_REQUEST_LATENCY_BUCKETS,
                                  queue=VLLM_REQUEST_LATENCY_BUCKETS)


@dataclass(frozen=True)
class EngineState:
    """What a scrape renders: one model snapshot per DP rank, plus serving facts."""

    model_name: str
    tp: int
    created_unix: float  # wall-clock start of the current engine generation
    ranks: tuple[ModelSnapshot, ...]
    role: str = "unified"  # disaggregated prefill/decode: SGLang's engine_type


StateSource = Callable[[], EngineState]
Series = list[tuple[dict[str, str], float]]
Scheduler = tuple[dict[str, str], ModelSnapshot, int]  # (labels, DP rank's snapshot, scheduler pid)


# -- sample builders shared by the flavors ------------------------------------------------------

def gauge(name: str, doc: str, series: Series) -> Metric:
    family = Metric(name, doc, "gauge")
    for labels, value in series:
        family.add_sample(name, labels, value)
    return family


def counter(name: str, doc: str, series: Series, created: float | None = None) -> Metric:
    """`name` is the wire name with `_total`; the family is named without it, as the client does."""
    base = name.removesuffix("_total")
    family = Metric(base, doc, "counter")
    for labels, value in series:
        family.add_sample(base + "_total", labels, value)
        if created is not None:
            family.add_sample(base + "_created", labels, created)
    return family


def histogram(name: str, doc: str, series: list[tuple[dict[str, str], Histogram]],
              created: float | None = None, multiprocess: bool = False) -> Metric:
    """Single-process order: buckets, _count, _sum[, _created]; multiprocess: _sum, buckets, _count."""
    family = Metric(name, doc, "histogram")
    for labels, hist in series:
        if multiprocess:
            family.add_sample(name + "_sum", labels, hist.sum)
        for bound, cumulative in hist.cumulative():
            family.add_sample(name + "_bucket", {**labels, "le": floatToGoString(bound)}, cumulative)
        family.add_sample(name + "_count", labels, hist.count)
        if not multiprocess:
            family.add_sample(name + "_sum", labels, hist.sum)
        if created is not None:
            family.add_sample(name + "_created", labels, created)
    return family


# -- vLLM ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class VllmDialect:
    usage: str
    prefix_cache: str  # name prefix of the prefix-cache counters
    itl: str
    engine_label: bool
    created: bool
    waiting_by_reason: bool
    cache_config_as_info: bool
    extra_cache_config: dict[str, str]  # CacheConfig fields of that era beyond the common ones
    kv_cache_size_tokens: bool = False  # vLLM #42206: group-aware token capacity in cache_config_info


VLLM_V1 = VllmDialect(usage="vllm:kv_cache_usage_perc", prefix_cache="vllm:prefix_cache_",
                      itl="vllm:inter_token_latency_seconds", engine_label=True, created=True,
                      waiting_by_reason=True, cache_config_as_info=False,
                      extra_cache_config={"num_cpu_blocks": "None", "prefix_caching_hash_algo": "sha256"})
VLLM_V1_KV_TOKENS = replace(VLLM_V1, kv_cache_size_tokens=True)
VLLM_V0 = VllmDialect(usage="vllm:gpu_cache_usage_perc", prefix_cache="vllm:gpu_prefix_cache_",
                      itl="vllm:time_per_output_token_seconds", engine_label=False, created=False,
                      waiting_by_reason=False, cache_config_as_info=True,
                      extra_cache_config={"cpu_offload_gb": "0", "is_attention_free": "False",
                                          "num_cpu_blocks": "2048", "swap_space_bytes": "4294967296"})


class VllmCollector(Collector):
    def __init__(self, source: StateSource, dialect: VllmDialect):
        self.source = source
        self.dialect = dialect

    def collect(self) -> Iterator[Metric]:
        state, d = self.source(), self.dialect
        created = state.created_unix if d.created else None
        ranks = [(self._labels(state, index), snap) for index, snap in enumerate(state.ranks)]

        def each(value: Callable[[ModelSnapshot], float]) -> Series:
            return [(labels, float(value(snap))) for labels, snap in ranks]

        def hist(name: str, doc: str, key: str) -> Metric:
            return histogram(name, doc, [(labels, snap.histograms[key]) for labels, snap in ranks], created)

        yield gauge("vllm:num_requests_running", "Number of requests in model execution batches.",
                    each(lambda s: s.report.running))
        yield gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
                    each(lambda s: s.report.waiting))
        if d.waiting_by_reason:
            # Deferred: requests waiting for their KV transfer (a disaggregated decode side); the rest wait for
            # capacity.
            yield gauge("vllm:num_requests_waiting_by_reason", "Number of requests waiting, by reason.",
                        [({**labels, "reason": reason},
                          float(snap.deferred if reason == "deferred" else snap.report.waiting - snap.deferred))
                         for labels, snap in ranks for reason in ("capacity", "deferred")])
        yield gauge(d.usage, "KV-cache usage. 1 means 100 percent usage.",
                    each(lambda s: s.report.used_blocks / s.config.num_blocks))
        yield counter(d.prefix_cache + "queries_total",
                      "Prefix cache queries, in terms of number of queried tokens.",
                      each(lambda s: s.counters.prefix_queried_tokens), created)
        yield counter(d.prefix_cache + "hits_total", "Prefix cache hits, in terms of number of cached tokens.",
                      each(lambda s: s.counters.prefix_hit_tokens), created)
        yield counter("vllm:num_preemptions_total", "Cumulative number of preemption from the engine.",
                      each(lambda s: s.counters.preemptions_rescheduled), created)
        yield counter("vllm:prompt_tokens_total", "Number of prefill tokens processed.",
                      each(lambda s: s.counters.prompt_tokens), created)
        yield counter("vllm:generation_tokens_total", "Number of generation tokens processed.",
                      each(lambda s: s.counters.generation_tokens), created)
        yield counter("vllm:request_success_total", "Count of successfully processed requests.",
                      [({**labels, "finished_reason": reason},
                        float(snap.counters.finished_requests if reason == "stop" else 0))
                       for labels, snap in ranks for reason in ("stop", "length", "abort")], created)
        yield hist("vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.",
                   "iteration_tokens")
        yield hist("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", "ttft")
        yield hist(d.itl, "Histogram of inter-token latency in seconds.", "itl")
        yield hist("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", "e2e")
        yield hist("vllm:request_queue_time_seconds",
                   "Histogram of time spent in WAITING phase for request.", "queue")
        yield self._cache_config(state)
        if d.engine_label and state.ranks[0].config.offload_blocks:
            yield from self._offload(ranks, created)

    @staticmethod
    def _offload(ranks: list[tuple[dict[str, str], ModelSnapshot]], created: float | None) -> Iterator[Metric]:
        """vLLM 0.33's native CPU offload (OffloadingConnector, one block per chunk) and the engine's
        by-source and external (connector) prefix counters. The tier's usage is its non-evictable share:
        the chunks whose store is still in flight."""
        def each(value: Callable[[ModelSnapshot], float]) -> Series:
            return [(labels, float(value(snap))) for labels, snap in ranks]

        yield counter("vllm:external_prefix_cache_queries_total", "External prefix cache queries from KV "
                      "connector cross-instance cache sharing, in terms of number of queried tokens.",
                      each(lambda s: s.counters.offload_queried_tokens), created)
        yield counter("vllm:external_prefix_cache_hits_total", "External prefix cache hits from KV connector "
                      "cross-instance cache sharing, in terms of number of cached tokens.",
                      each(lambda s: s.counters.offload_hit_tokens), created)
        yield counter("vllm:prompt_tokens_cached_by_source_total", "Cached prompt tokens by where the KV came from.",
                      [({**labels, "source": source}, float(value(snap))) for labels, snap in ranks
                       for source, value in (("device", lambda s: s.counters.prefix_hit_tokens),
                                             ("host", lambda s: s.counters.offload_hit_tokens))], created)
        for name, doc, value in (
            ("vllm:kv_offload_load_bytes_total", "Total bytes loaded from offload storage to GPU.",
             lambda s: s.counters.offload_loaded_blocks * s.config.block_bytes),
            ("vllm:kv_offload_load_time_total", "Total load time from offload storage to GPU, in seconds.",
             lambda s: s.counters.offload_load_seconds),
            ("vllm:kv_offload_store_bytes_total", "Total bytes stored from GPU to offload storage.",
             lambda s: s.counters.offload_stored_blocks * s.config.block_bytes),
            ("vllm:kv_offload_store_time_total", "Total store time from GPU to offload storage, in seconds.",
             lambda s: s.counters.offload_store_seconds),
            ("vllm:kv_offload_allocation_failure_total", "Number of KV offload store allocation attempts that "
             "failed.", lambda s: s.counters.offload_store_failures),
        ):
            yield counter(name, doc, each(value), created)
        yield gauge("vllm:kv_offload_cpu_cache_usage_perc", "CPU offload cache usage.",
                    each(lambda s: s.offload_pinned_blocks / s.config.offload_blocks))
        yield gauge("vllm:kv_offload_config_info", "Static configuration of the KV offload managers of this "
                    "engine instance.", [({**labels, "cpu_blocks_per_chunk": "1",
                                           "cpu_kv_cache_size_bytes": str(snap.config.offload_blocks
                                                                          * snap.config.block_bytes),
                                           "cpu_kv_cache_size_tokens": str(snap.config.offload_blocks
                                                                           * snap.config.block_size),
                                           "cpu_num_chunks": str(snap.config.offload_blocks)}, 1.0)
                                         for labels, snap in ranks])

    def _labels(self, state: EngineState, index: int) -> dict[str, str]:
        labels = {"model_name": state.model_name}
        if self.dialect.engine_label:
            labels["engine"] = str(index)
        return labels

    def _cache_config(self, state: EngineState) -> Metric:
        """vLLM's frontend adds up `num_gpu_blocks` over its DP engines at their ready handshake (each
        engine's count includes its null block) and writes that one CacheConfig into every engine's
        series; `kv_cache_size_tokens` and `kv_cache_max_concurrency` keep the first engine's values."""
        doc = "Information of the LLMEngine CacheConfig"
        first = state.ranks[0].config
        common = {
            "block_size": str(first.block_size),
            "cache_dtype": "auto",
            "enable_prefix_caching": str(first.enable_prefix_caching),
            "gpu_memory_utilization": "0.9",
            "num_gpu_blocks": str(sum(snap.config.num_blocks + 1 for snap in state.ranks)),
            "num_gpu_blocks_override": "None",
            "sliding_window": "None",
            **self.dialect.extra_cache_config,
        }
        if self.dialect.kv_cache_size_tokens:
            # kv_cache_utils: concurrency = blocks / blocks one max-length request needs; tokens = int(that x length)
            max_model_len = first.effective_max_model_len
            concurrency = (first.num_blocks + 1) / -(-max_model_len // first.block_size)
            common["kv_cache_max_concurrency"] = str(concurrency)
            common["kv_cache_size_tokens"] = str(int(concurrency * max_model_len))
        infos = [{**common, "engine": str(index)} if self.dialect.engine_label else common
                 for index in range(len(state.ranks))]
        if self.dialect.cache_config_as_info:
            family = InfoMetricFamily("vllm:cache_config", doc)
            for info in infos:
                family.add_metric([], info)
            return family
        return gauge("vllm:cache_config_info", doc, [(info, 1.0) for info in infos])


# -- SGLang -------------------------------------------------------------------------------------

# The multiprocess collector replaces every HELP text with this.
MP = "Multiprocess metric"


class SglangCollector(Collector):
    def __init__(self, source: StateSource, seed: int = 0):
        self.source = source
        self._order_rng = random.Random(seed)
        self._order_lock = threading.Lock()
        # Scheduler processes have their own pids; `num_retracted_reqs` shows them.
        self._pid_base = os.getpid() + 1

    def collect(self) -> Iterator[Metric]:
        state = self.source()
        schedulers = list(self._schedulers(state))
        for family in (*self._scheduler_families(schedulers), *self._tokenizer_families(state)):
            yield self._reorder(family)

    def _schedulers(self, state: EngineState) -> Iterator[Scheduler]:
        """Every scheduler that reports: each TP rank of each DP rank."""
        for dp_rank, snap in enumerate(state.ranks):
            for tp_rank in range(state.tp):
                labels = {"engine_type": state.role, "model_name": state.model_name,
                          "moe_ep_rank": "0", "pp_rank": "0", "tp_rank": str(tp_rank)}
                if len(state.ranks) > 1:
                    labels["dp_rank"] = str(dp_rank)
                yield labels, snap, self._pid_base + dp_rank * state.tp + tp_rank

    def _scheduler_families(self, schedulers: list[Scheduler]) -> Iterable[Metric]:
        def each(value: Callable[[ModelSnapshot], float]) -> Series:
            return [(labels, float(value(snap))) for labels, snap, _ in schedulers]

        def tokens(blocks: Callable[[ModelSnapshot], int]) -> Callable[[ModelSnapshot], float]:
            return lambda s: blocks(s) * s.config.block_size

        yield gauge("sglang:num_running_reqs", MP, each(lambda s: s.report.running))
        yield gauge("sglang:num_queue_reqs", MP, each(lambda s: s.report.waiting))
        yield gauge("sglang:num_used_tokens", MP, each(tokens(lambda s: s.report.used_blocks)))
        yield gauge("sglang:token_usage", MP,
                    each(lambda s: round(s.report.used_blocks / s.config.num_blocks, 2)))
        yield gauge("sglang:kv_used_tokens", MP, each(tokens(lambda s: s.report.used_blocks)))
        yield gauge("sglang:kv_available_tokens", MP, each(tokens(lambda s: s.report.free_blocks)))
        yield gauge("sglang:kv_evictable_tokens", MP, each(tokens(lambda s: s.report.evictable_blocks)))
        yield gauge("sglang:max_total_num_tokens", MP, each(lambda s: s.config.capacity_tokens))
        yield gauge("sglang:page_size", MP, each(lambda s: s.config.block_size))
        yield gauge("sglang:num_pages", MP, each(lambda s: s.config.num_blocks))
        yield gauge("sglang:cache_hit_rate", MP, each(lambda s: s.report.prefill_hit_ratio))
        yield gauge("sglang:gen_throughput", MP, each(lambda s: s.report.generation_throughput))
        yield gauge("sglang:utilization", MP, each(lambda s: 0.0))
        yield gauge("sglang:fwd_occupancy", MP, each(lambda s: math.nan))
        # A gauge left in multiprocess mode "all": one series per scheduler pid.
        yield gauge("sglang:num_retracted_reqs", MP,
                    [({**labels, "pid": str(pid)}, float(snap.report.preemptions_since_last))
                     for labels, snap, pid in schedulers])
        retracted = [(labels, snap, pid) for labels, snap, pid in schedulers if snap.counters.preemptions]
        if retracted:
            for name, value in (
                ("sglang:num_retracted_requests_total", lambda s: s.counters.preemptions),
                ("sglang:num_retracted_input_tokens_total", lambda s: s.counters.retracted_input_tokens),
                ("sglang:num_retracted_output_tokens_total", lambda s: s.counters.retracted_output_tokens),
            ):
                yield counter(name, MP, [(labels, float(value(snap))) for labels, snap, _ in retracted])
        yield counter("sglang:realtime_tokens_total", MP, [
            ({**labels, "mode": mode}, float(getattr(snap.counters, field)))
            for labels, snap, _ in schedulers
            for mode, field in (("prefill_compute", "prefill_compute_tokens"),
                                ("prefill_cache", "prefill_cache_tokens"), ("decode", "decode_tokens"))])
        queued = [(labels, snap.histograms["queue"]) for labels, snap, _ in schedulers
                  if snap.histograms["queue"].count]
        if queued:
            yield histogram("sglang:queue_time_seconds", MP, queued, multiprocess=True)
        if schedulers[0][1].config.offload_blocks:  # --enable-hierarchical-cache: the host tier
            yield gauge("sglang:hicache_host_total_tokens", MP,
                        each(lambda s: s.config.offload_blocks * s.config.block_size))
            yield gauge("sglang:hicache_host_used_tokens", MP, each(tokens(lambda s: s.offload_used_blocks)))
            # The radix cache's collector (0.5.23): its own rank labels, `pool` on the token counters; tokens
            # are the logical count on every TP rank, bytes each rank's shard.
            radix = [({"cache_type": "HiRadixCache", "dp_rank": labels.get("dp_rank", "0"), "pp_rank": "0",
                       "tp_rank": labels["tp_rank"]}, snap) for labels, snap, _ in schedulers]
            shard = len({labels["tp_rank"] for labels, _, _ in schedulers})
            for direction, tokens_name, bytes_name, seconds_name in (
                    ("loaded", "sglang:load_back_tokens_total", "sglang:load_back_bytes_total",
                     "sglang:load_back_duration_seconds"),
                    ("stored", "sglang:hicache_backup_tokens_total", "sglang:hicache_backup_bytes_total",
                     "sglang:hicache_backup_duration_seconds")):
                field = f"offload_{direction}_blocks"
                yield counter(tokens_name, MP, [({**labels, "pool": "kv"},
                                                 float(getattr(snap.counters, field) * snap.config.block_size))
                                                for labels, snap in radix])
                yield counter(bytes_name, MP, [(labels, getattr(snap.counters, field) * snap.config.block_bytes / shard)
                                               for labels, snap in radix])
                key = "offload_load" if direction == "loaded" else "offload_store"
                yield histogram(seconds_name, MP, [(labels, snap.histograms[key]) for labels, snap in radix],
                                multiprocess=True)

    def _tokenizer_families(self, state: EngineState) -> Iterable[Metric]:
        labels = {"engine_type": state.role, "model_name": state.model_name}
        streaming = {**labels, "is_streaming": "true"}

        def total(field: str) -> float:
            return float(sum(getattr(s.counters, field) for s in state.ranks))

        if total("finished_requests"):
            yield counter("sglang:prompt_tokens_total", MP, [(streaming, total("finished_prompt_tokens"))])
            yield counter("sglang:generation_tokens_total", MP,
                          [(streaming, total("finished_generation_tokens"))])
            yield counter("sglang:num_requests_total", MP, [(labels, total("finished_requests"))])
        device = total("finished_cached_tokens") - total("finished_offload_cached_tokens")
        # Each source's child appears at its first increment.
        sources = [({**labels, "cache_source": source}, value)
                   for source, value in (("device", device), ("host", total("finished_offload_cached_tokens")))
                   if value]
        if sources:
            yield counter("sglang:cached_tokens_total", MP, sources)
        for name, key, key_labels in (
            ("sglang:time_to_first_token_seconds", "ttft", streaming),
            ("sglang:inter_token_latency_seconds", "itl", labels),
            ("sglang:e2e_request_latency_seconds", "e2e", streaming),
        ):
            merged = Histogram.merged([s.histograms[key] for s in state.ranks])
            if merged.count:
                yield histogram(name, MP, [(key_labels, merged)], multiprocess=True)

    def _reorder(self, family: Metric) -> Metric:
        """Shuffle whole children (a histogram child's samples stay together), as multiprocess files do."""
        children: dict[tuple, list] = {}
        for sample in family.samples:
            key = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "le"))
            children.setdefault(key, []).append(sample)
        groups = list(children.values())
        with self._order_lock:
            self._order_rng.shuffle(groups)
        family.samples = [sample for group in groups for sample in group]
        return family


# -- TensorRT-LLM -------------------------------------------------------------------------------

class TrtllmCollector(Collector):
    def __init__(self, source: StateSource):
        self.source = source
        self._pid = str(os.getpid())

    def collect(self) -> Iterator[Metric]:
        state = self.source()
        snap = state.ranks[0]
        labels = {"engine_type": "pytorch", "model_name": state.model_name}
        # Gauges are created without multiprocess_mode, so the multiprocess collector adds `pid`.
        with_pid = {**labels, "pid": self._pid}
        report, config, counters = snap.report, snap.config, snap.counters
        for name, doc, value in (
            ("trtllm_kv_cache_utilization", "KV cache utilization", report.used_blocks / config.num_blocks),
            ("trtllm_kv_cache_max_blocks", "Maximum number of KV cache blocks", config.num_blocks),
            ("trtllm_kv_cache_free_blocks", "Number of free KV cache blocks", config.num_blocks - report.used_blocks),
            ("trtllm_kv_cache_used_blocks", "Number of used KV cache blocks", report.used_blocks),
            ("trtllm_kv_cache_tokens_per_block", "Number of tokens per KV cache block", config.block_size),
            ("trtllm_num_requests_running", "Number of active requests", report.running),
            ("trtllm_num_requests_waiting", "Number of queued requests", report.waiting),
            ("trtllm_num_paused_requests", "Number of paused requests", report.paused),
        ):
            yield gauge(name, doc, [(with_pid, float(value))])
        for name, doc, value in (
            ("trtllm_prompt_tokens_total", "Cumulative number of prompt (input) tokens processed.",
             counters.finished_prompt_tokens),
            ("trtllm_generation_tokens_total", "Cumulative number of generation (output) tokens produced.",
             counters.finished_generation_tokens),
            ("trtllm_prompt_cached_tokens_total", "Process-lifetime total prompt tokens served from KV cache.",
             counters.finished_cached_tokens),
        ):
            yield counter(name, doc, [(labels, float(value))])
        yield counter("trtllm_request_success_total", "Count of successfully processed requests.",
                      [({**labels, "finished_reason": "stop"}, float(counters.finished_requests))])
        for name, doc, key in (
            ("trtllm_time_to_first_token_seconds", "Histogram of time to first token in seconds.", "ttft"),
            ("trtllm_time_per_output_token_seconds", "Histogram of time per output token in seconds.", "itl"),
            ("trtllm_e2e_request_latency_seconds", "Histogram of end to end request latency in seconds.", "e2e"),
            ("trtllm_request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.", "queue"),
        ):
            yield histogram(name, doc, [(labels, snap.histograms[key])], multiprocess=True)


# -- flavors ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Flavor:
    name: str
    reporting: Reporting
    default_port: int
    default_model: str
    max_dp: int | None
    make_collector: Callable[[StateSource, int], Collector]  # (state source, seed)
    python_collectors: bool  # single-process clients also show python_* families
    metrics_path: str = "/metrics"


FLAVORS: dict[str, Flavor] = {
    "vllm-v1": Flavor(
        name="vllm-v1",
        reporting=Reporting(buckets=VLLM_V1_BUCKETS, queue_time_at_finish=True),
        default_port=8000, default_model="meta-llama/Llama-3.1-8B-Instruct", max_dp=None,
        make_collector=lambda source, seed: VllmCollector(source, VLLM_V1), python_collectors=True),
    "vllm-v1-kv-tokens": Flavor(
        name="vllm-v1-kv-tokens",
        reporting=Reporting(buckets=VLLM_V1_BUCKETS, queue_time_at_finish=True),
        default_port=8000, default_model="meta-llama/Llama-3.1-8B-Instruct", max_dp=None,
        make_collector=lambda source, seed: VllmCollector(source, VLLM_V1_KV_TOKENS), python_collectors=True),
    "vllm-v0": Flavor(
        name="vllm-v0",
        reporting=Reporting(buckets=VLLM_V0_BUCKETS, queue_time_at_finish=True),
        default_port=8000, default_model="meta-llama/Llama-3.1-8B-Instruct", max_dp=1,
        make_collector=lambda source, seed: VllmCollector(source, VLLM_V0), python_collectors=True),
    "sglang": Flavor(
        name="sglang",
        reporting=Reporting(buckets=SGLANG_BUCKETS, queue_time_at_finish=False,
                            report_every_decode_steps=SGLANG_DECODE_LOG_INTERVAL),
        default_port=30000, default_model="meta-llama/Llama-3.1-8B-Instruct", max_dp=None,
        make_collector=lambda source, seed: SglangCollector(source, seed), python_collectors=False),
    "trtllm": Flavor(
        name="trtllm",
        reporting=Reporting(buckets=TRTLLM_BUCKETS, queue_time_at_finish=True, report_idle_s=math.inf,
                            report_when_requests_finish=True),
        default_port=8000, default_model="meta-llama/Llama-3.1-8B-Instruct", max_dp=1,
        make_collector=lambda source, seed: TrtllmCollector(source), python_collectors=False,
        metrics_path="/prometheus/metrics"),
}
