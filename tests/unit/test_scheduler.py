"""exporter.runtime.scheduler: every target once per interval, spread over the interval by its phase."""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter

from kvcache_exporter.runtime.scheduler import Phases, Scheduler, phase_of


class FakeTarget:
    def __init__(self, name: str, hang_seconds: float = 0.0):
        self.name = name
        self.polls = 0
        self.closed = 0
        self._hang = hang_seconds

    async def poll(self) -> None:
        self.polls += 1
        await asyncio.sleep(self._hang)

    def close(self) -> None:
        self.closed += 1


def test_phases_spread_a_fleet_evenly_over_the_interval():
    slots = Counter(int(phase_of(f"engine-{i}") * 50) for i in range(2000))
    # 40 per slot on average; a uniform hash keeps every slot within +-50 % (deterministic: fixed names)
    assert len(slots) == 50
    assert 20 <= min(slots.values()) and max(slots.values()) <= 60


def test_a_phase_depends_on_the_name_only():
    assert phase_of("engine-7") == phase_of("engine-7")
    assert phase_of("engine-7") != phase_of("engine-8")
    assert 0.0 <= phase_of("engine-7") < 1.0


def test_every_target_falls_due_once_per_interval_however_the_time_is_cut():
    targets = [FakeTarget(f"t{i}") for i in range(500)]
    phases = Phases(targets)
    rng = random.Random(3)
    position, counts = 1.0, Counter()
    while position < 5.0:
        following = min(position + rng.uniform(0.0005, 0.3), 5.0)
        counts.update(t.name for t in phases.due(position, following))
        position = following
    assert counts == Counter({t.name: 4 for t in targets})


def test_a_window_of_a_whole_interval_or_more_gives_everyone_once():
    targets = [FakeTarget(f"t{i}") for i in range(50)]
    assert sorted(t.name for t in Phases(targets).due(2.3, 5.9)) == sorted(t.name for t in targets)


def test_a_hanging_target_is_skipped_while_the_others_go_on():
    healthy = [FakeTarget(f"t{i}") for i in range(10)]
    stuck = FakeTarget("stuck", hang_seconds=3600)
    scheduler = Scheduler(healthy + [stuck], interval=0.2)
    scheduler.start()
    try:
        time.sleep(1.5)  # the first round and about six intervals
        assert stuck.polls == 1  # never started again while its poll hangs
        assert min(t.polls for t in healthy) >= 3
    finally:
        started = time.monotonic()
        scheduler.stop()
    assert time.monotonic() - started < 1.0  # the hanging poll is cancelled, not waited for
    assert all(t.closed == 1 for t in healthy + [stuck])


def test_a_scheduler_with_no_targets_runs_work_given_from_another_thread():
    scheduler = Scheduler([], interval=0.2)
    scheduler.start()
    try:
        probed = FakeTarget("probed")
        scheduler.run(probed.poll())
        assert probed.polls == 1
    finally:
        scheduler.stop()
