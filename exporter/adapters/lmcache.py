"""LMCache's own /metrics page (LMCache/LMCache lmcache/observability.py, PrometheusLogger, 0.5.6), and its
series wherever they appear.

With `internal_api_server_enabled`, LMCache's internal API server serves `GET /metrics` from each process:
the scheduler on `internal_api_server_port_start` (6999), TP worker i on that port + 1 + i. A page is one
process's registry: `lmcache:*` families only, no vLLM series, so there is no GPU pool to read (no usage, no
queue, no pressure state). The workers keep the KV (each its shard) and answer the lookups (every worker counts
every lookup): the worker pages carry the values; the scheduler's has values only with
`enable_scheduler_bypass_lookup`. With PROMETHEUS_MULTIPROC_DIR the same series reach vLLM's page, where the
vLLM adapter reads them from the names below.
"""

from __future__ import annotations

from .. import contract
from .base import Adapter, Series

# The lookup counters: the external cache's queried and hit tokens. Never the retrieve path
# (num_hit_tokens / num_requested_tokens), which asks only for tokens LMCache has and so reads about 1.
LOOKUP_TOKENS = "lmcache:num_lookup_tokens_total"
LOOKUP_HITS = "lmcache:num_lookup_hits_total"
TIER_SERIES = (
    # Bytes per tier, no capacity. Each TP worker holds its own shard of the KV: the tier holds the sum.
    *(Series("tier_used_bytes", (name,), sum_over=("worker_id",), labels=(tier,))
      for tier, name in (("cpu", "lmcache:local_cache_usage"), ("disk", "lmcache:local_storage_usage"),
                         ("remote", "lmcache:remote_cache_usage"))),
    # The CPU backend evicts the same chunks on every TP worker (each its own shard): one worker's count.
    Series("tier_evictions_total", ("lmcache:local_cpu_evict_keys_count_total",), "counter", labels=("cpu",)),
)
_SERIES = (
    Series("external_cache_queried_tokens_total", (LOOKUP_TOKENS,), "counter"),
    Series("external_cache_hit_tokens_total", (LOOKUP_HITS,), "counter"),
    *TIER_SERIES,
)


class LmcacheAdapter(Adapter):
    engine = "lmcache"
    title = "LMCache"
    marker = r"lmcache:"
    detect_last = True  # on vLLM's page (PROMETHEUS_MULTIPROC_DIR) its series sit next to the engine's
    rank_label = None  # a page is one process: one worker, or the scheduler
    model_label = "served_model_name"  # what vLLM's `model_name` holds; LMCache's `model_name` is the model path
    series = _SERIES
    # Everything else: the GPU pool, the queue, the request latencies and their derivations, the pressure
    # state, and the tier families LMCache has no source for (capacity, transfers, store failures, hits by
    # source). Bytes per token comes from the target's configuration, not from the engine.
    not_reported = frozenset(contract.names(fed_by="poll")) - {s.concept for s in _SERIES} - {"bytes_per_token"}
