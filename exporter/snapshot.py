"""What an adapter hands on: one engine's page, normalized to engine-independent concepts (the
contract's family names without the `kvcache_` prefix, exporter/contract.py)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class Histogram:
    buckets: list[tuple[float, float]]  # (upper bound, cumulative count), ascending, ends at +Inf
    sum: float
    count: float


@dataclass(slots=True)
class RankValues:
    """One data-parallel replica's pool and queue: values keyed by contract family names."""

    gauges: dict[str, float] = field(default_factory=dict)
    counters: dict[str, float] = field(default_factory=dict)
    histograms: dict[str, Histogram] = field(default_factory=dict)
    # Families with labels of their own (the contract's offload group): name -> {label values, in the family's
    # label order -> value}.
    labelled: dict[str, dict[tuple[str, ...], float]] = field(default_factory=dict)


@dataclass(slots=True)
class Snapshot:
    engine: str
    model: str
    version: str
    ranks: dict[str, RankValues]  # keyed by dp_rank ("0" where the engine has none)
    role: str | None = None  # prefill, decode or unified where the page says it (contract.ROLES)
    # How the engine's prefill pools hold KV for export (a key of contract.EXPORT_HOLDS); None: not known.
    export_hold: str | None = None
