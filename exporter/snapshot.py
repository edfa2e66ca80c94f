"""What an adapter hands on: one engine's page, normalized to engine-independent concepts."""

from __future__ import annotations

from dataclasses import dataclass, field

# Concept names shared by the adapters (which fill them) and derivation (which reads them).
GAUGES = (
    "usage_ratio",            # 0..1, evictable prefix-cache blocks count as free
    "capacity_blocks",        # usable blocks in the pool
    "block_size_tokens",
    "capacity_tokens",
    "used_tokens",            # held by live requests, where the engine reports it in tokens
    "evictable_tokens",
    "requests_running",
    "requests_waiting",
    "requests_waiting_for_capacity",
)
COUNTERS = (
    "preemptions_total",
    "prefix_cache_queried_tokens_total",
    "prefix_cache_hit_tokens_total",
    "prompt_tokens_total",
    "generation_tokens_total",
)
HISTOGRAMS = (
    "time_to_first_token_seconds",
    "inter_token_latency_seconds",
    "queue_time_seconds",
    "e2e_request_latency_seconds",
)


@dataclass(slots=True)
class Histogram:
    buckets: list[tuple[float, float]]  # (upper bound, cumulative count), ascending, ends at +Inf
    sum: float
    count: float


@dataclass(slots=True)
class RankValues:
    """One data-parallel replica's pool and queue: values keyed by the concept names above."""

    gauges: dict[str, float] = field(default_factory=dict)
    counters: dict[str, float] = field(default_factory=dict)
    histograms: dict[str, Histogram] = field(default_factory=dict)


@dataclass(slots=True)
class Snapshot:
    engine: str
    model: str
    version: str
    ranks: dict[str, RankValues]  # keyed by dp_rank ("0" where the engine has none)
