"""Per-minute figures from what changed between reads: preemptions and capacity misses per minute,
the prefix hit ratio and p90 TTFT over the pressure state's window (`window_seconds`, 60 s by default).

Each pool keeps its readings of the last window, one per engine poll (a read that finds the same
poll again adds nothing), and drops older ones as the exporter drops its preemption history: once top
has read for a whole window, a pool's preemption rate is the one its state was derived from. A step in
which a counter went down is an engine restart: it counts nothing, so a restart never shows as a
burst, a negative rate or a hit ratio outside [0, 1].
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

from ..thresholds import DEFAULT as THRESHOLDS
from .source import CAPACITY_MISSES, Frame, Pool


@dataclass(frozen=True, slots=True)
class Rates:
    preemptions_per_min: float | None = None
    prefix_hit_ratio: float | None = None
    ttft_p90_seconds: float | None = None
    capacity_misses_per_min: float | None = None
    seconds: float | None = None  # the time the figures cover: the window, or less until top has read that long


def histogram_quantile(q: float, buckets: Sequence[tuple[float, float]]) -> float | None:
    """PromQL's histogram_quantile over (upper bound, cumulative count) pairs, ascending, ending at +Inf:
    linear interpolation inside the bucket that holds the rank; the highest finite bound when that
    bucket is +Inf. None without observations."""
    if len(buckets) < 2 or buckets[-1][0] != math.inf or not buckets[-1][1] > 0:
        return None
    rank = q * buckets[-1][1]
    index = next(i for i, (_, count) in enumerate(buckets) if count >= rank)
    if index == len(buckets) - 1:
        return buckets[-2][0]
    upper, upper_count = buckets[index]
    if index == 0:
        if upper <= 0:
            return upper
        lower, lower_count = 0.0, 0.0
    else:
        lower, lower_count = buckets[index - 1]
    return lower + (upper - lower) * (rank - lower_count) / (upper_count - lower_count)


def _increase(points: Sequence[Pool], values: Callable[[Pool], tuple[float, ...] | None]) -> tuple[float, ...] | None:
    """The summed step increases of `values` over the points; a step where any value fell (a restart)
    or one that lacks them adds nothing. None when no step had the values."""
    total: list[float] | None = None
    for before, after in zip(points, points[1:]):
        a, b = values(before), values(after)
        if a is None or b is None or len(a) != len(b):
            continue
        if total is None:
            total = [0.0] * len(b)
        if all(y >= x for x, y in zip(a, b)):
            total = [t + y - x for t, x, y in zip(total, a, b)]
    return tuple(total) if total is not None else None


def _counter(name: str) -> Callable[[Pool], tuple[float, ...] | None]:
    return lambda pool: (pool.counters[name],) if name in pool.counters else None


def _prefix(pool: Pool) -> tuple[float, ...] | None:
    """Prompt tokens looked up, then those served from any cache: the engine's prefix-cache hits and, where the
    engine counts them apart, an external cache's (vLLM's hits are its GPU pool's; its KV connector's, LMCache or
    its CPU offload, are counted as external hits, over the tokens the GPU pool did not have). SGLang's hits
    already cover every source, so HIT means the same on every engine."""
    counters = pool.counters
    if "prefix_cache_hit_tokens_total" not in counters or "prefix_cache_queried_tokens_total" not in counters:
        return None
    external = counters.get("external_cache_hit_tokens_total")
    return (counters["prefix_cache_queried_tokens_total"], counters["prefix_cache_hit_tokens_total"],
            *(() if external is None else (external,)))


def _ttft_counts(pool: Pool) -> tuple[float, ...] | None:
    return tuple(count for _, count in pool.ttft) if pool.ttft else None


class RateWindow:
    """The readings of the last `window` seconds of every pool, and the figures they give."""

    def __init__(self, window: float = THRESHOLDS.window_seconds):
        self.window = window
        self._points: dict[tuple, list[Pool]] = {}

    def add(self, frame: Frame) -> None:
        """A read's pools; a pool gone from the page is forgotten (it may come back as a new one)."""
        kept: dict[tuple, list[Pool]] = {}
        for key, pool in frame.pools.items():
            points = self._points.get(key, [])
            if not points or pool.at > points[-1].at:
                points = points + [pool]
            cutoff = pool.at - self.window
            first = 0
            while first + 1 < len(points) and points[first + 1].at <= cutoff:
                first += 1  # one point at or before the cutoff stays: the base of the window
            kept[key] = points[first:]
        self._points = kept

    def rates(self, key: tuple) -> Rates:
        points = self._points.get(key, [])
        if len(points) < 2:
            return Rates()
        seconds = points[-1].at - points[0].at
        minutes = seconds / 60.0
        preempted = _increase(points, _counter("preemptions_total"))
        misses = _increase(points, _counter(CAPACITY_MISSES))
        prefix = _increase(points, _prefix)
        ttft = _increase(points, _ttft_counts)
        bounds = [bound for bound, _ in points[-1].ttft]
        return Rates(
            preemptions_per_min=preempted[0] / minutes if preempted else None,
            prefix_hit_ratio=min(1.0, max(0.0, sum(prefix[1:]) / prefix[0])) if prefix and prefix[0] > 0 else None,
            ttft_p90_seconds=histogram_quantile(0.9, list(zip(bounds, ttft))) if ttft else None,
            capacity_misses_per_min=misses[0] / minutes if misses else None,
            seconds=seconds,
        )
