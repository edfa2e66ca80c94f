"""Rates the exporter and `top` derive stay right when the polls are not evenly spaced (phase-locked
polling moves a target's phase: one gap between 0.75 and 1.75 intervals, then the lock's own
jitter). Both divide a counter's increase by the time it took, never by a number of polls."""

from __future__ import annotations

import random

import pytest

from kvcache_exporter import derive
from kvcache_exporter.thresholds import DEFAULT
from kvcache_exporter.top.rates import RateWindow
from kvcache_exporter.top.source import Frame, Pool

INTERVAL = 5.0


def jittered_times(rng: random.Random, start: float, count: int) -> list[float]:
    """Poll times: mostly one interval apart with up to a quarter second of tick, now and then a gap
    of 0.75 to 1.75 intervals (the lock formed, moved or was lost)."""
    times, at = [], start
    for _ in range(count):
        gap = INTERVAL * rng.uniform(0.75, 1.75) if rng.random() < 0.2 else INTERVAL + rng.uniform(-0.25, 0.25)
        at += gap
        times.append(at)
    return times


def preemptions(t: float) -> float:
    """A counter whose rate changes: 0.01/s until t=200, 0.05/s until 400, then 0.02/s."""
    return 0.01 * min(t, 200.0) + 0.05 * max(0.0, min(t, 400.0) - 200.0) + 0.02 * max(0.0, t - 400.0)


@pytest.mark.parametrize("seed", range(4))
def test_the_exporters_rate_is_the_counters_increase_over_the_time_it_took(seed):
    rng = random.Random(seed)
    history: derive.History = ()
    times = jittered_times(rng, 0.0, 120)
    for t in times:
        history = derive.extend_history(history, t, preemptions(t), DEFAULT.window_seconds)
        first, last = history[0][0], history[-1][0]
        if len(history) >= 2:
            expected = (preemptions(last) - preemptions(first)) / (last - first)
            assert derive.rate(history) == pytest.approx(expected, rel=1e-9)
            assert last - first >= min(DEFAULT.window_seconds, last - times[0])  # the window, one point before it


@pytest.mark.parametrize("seed", range(4))
def test_a_steady_rate_reads_the_same_however_the_polls_are_spaced(seed):
    """0.03/s over the threshold of 0.02/s: thrashing at every poll, evenly spaced or not."""
    rng = random.Random(seed)
    even, jittered = (), ()
    for t_even, t_jittered in zip([INTERVAL * (i + 1) for i in range(60)], jittered_times(rng, 0.0, 60)):
        even = derive.extend_history(even, t_even, 0.03 * t_even, DEFAULT.window_seconds)
        jittered = derive.extend_history(jittered, t_jittered, 0.03 * t_jittered, DEFAULT.window_seconds)
        if len(even) < 2:
            continue  # a rate needs two polls
        assert derive.rate(jittered) == pytest.approx(derive.rate(even)) == pytest.approx(0.03)
        assert derive.pressure_state({"usage_ratio": 0.5}, derive.rate(jittered), DEFAULT) == "thrashing"


@pytest.mark.parametrize("seed", range(4))
def test_tops_per_minute_figures_divide_by_the_time_between_reads(seed):
    rng = random.Random(seed)
    window = RateWindow()
    for t in jittered_times(rng, 1000.0, 80):
        pool = Pool("t", "vllm", "m", "0", "unified", at=t, counters={"preemptions_total": preemptions(t - 1000.0)})
        window.add(Frame(t, {pool.key: pool}, {"t": True}))
        points = window._points[pool.key]
        if len(points) >= 2:
            first, last = points[0].at, points[-1].at
            expected = (preemptions(last - 1000.0) - preemptions(first - 1000.0)) / (last - first) * 60.0
            assert window.rates(pool.key).preemptions_per_min == pytest.approx(expected, rel=1e-9)
