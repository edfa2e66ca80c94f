"""exporter.runtime.scheduler and its timetable (exporter.runtime.phase.Timetable): every target once per
interval, spread over the interval by its phase, or timed for the scraper the polls lock onto."""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter

import pytest

from devtools import harness
from kvcache_exporter.runtime import phase
from kvcache_exporter.runtime.phase import ScrapeClock, Timetable, phase_of
from kvcache_exporter.runtime import scheduler as scheduler_module
from kvcache_exporter.runtime.scheduler import Scheduler
from kvcache_exporter.config import Config
from kvcache_exporter.runtime.shard import owner, polled_by


class FakeTarget:
    def __init__(self, name: str, hang_seconds: float = 0.0):
        self.name = name
        self.polls = 0
        self.closed = 0
        self.cancelled = 0
        self._hang = hang_seconds

    async def poll(self) -> None:
        self.polls += 1
        try:
            await asyncio.sleep(self._hang)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise

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


def run_timetable(timetable: Timetable, targets: list, start: float, end: float, interval: float,
                  rng: random.Random, on_tick=None) -> dict[str, list[float]]:
    """Ticks at random steps from `start` to `end`, as the loop does; the start times of each target's polls."""
    starts: dict[str, list[float]] = {t.name: [] for t in targets}
    now = start
    while now < end:
        tick = rng.uniform(0.0005, 0.3)
        if on_tick is not None:
            on_tick(now)
        for target in timetable.due(targets, now, now + tick, interval):
            starts[target.name].append(now)
        now += tick
    return starts


def test_every_target_falls_due_once_per_interval_however_the_time_is_cut():
    targets = [FakeTarget(f"t{i}") for i in range(500)]
    starts = run_timetable(Timetable(ScrapeClock()), targets, 1000.0, 1020.0, 1.0, random.Random(3))
    # The first round at once, then one per interval at the target's phase: 20 or 21 in 20 intervals.
    assert {len(times) for times in starts.values()} <= {20, 21}
    for name, times in starts.items():
        assert times[0] == 1000.0
        # Every later poll a tick (0.3 s) early at most, never late, at its phase of the interval.
        assert all(0.0 <= (phase_of(name) - t) % 1.0 <= 0.3 + 1e-9 for t in times[1:]), name


def test_a_locked_timetable_starts_each_poll_its_lead_before_the_scrape():
    """Prometheus scrapes every 2 s at 0.7 s past the second; polls every 1 s: each poll of each target
    starts within a tick before (scrape time - its lead) on the lattice of the poll interval."""
    clock = ScrapeClock()
    scrapes = [100.7 + 2.0 * i for i in range(40)]
    timetable = Timetable(clock)
    timetable.spread = 0.2
    targets = [FakeTarget(f"t{i}") for i in range(50)]
    for target in targets:
        for _ in range(phase.DURATIONS):
            timetable.finished(target.name, 0.03)
    fed = iter(scrapes)
    pending = [next(fed)]

    def on_tick(now: float) -> None:
        while pending[0] <= now:  # the scrapes that came by now
            clock.observe("10.0.0.9 Prometheus/2.53.0", pending[0], True)
            pending[0] = next(fed)
        clock.update(1.0, now)

    starts = run_timetable(timetable, targets, 100.0, 170.0, 1.0, random.Random(5), on_tick)
    assert clock.locked is not None and clock.locked.lattice.multiple_of(1.0) == 2
    for target in targets:
        lead = phase.lead(0.03, phase_of(target.name), 0.2, 1.0)
        locked = [t for t in starts[target.name] if t > 130.0]
        # Each start a tick (0.3 s) early at most, never late, on the lattice point `lead` before a scrape.
        assert all(0.0 <= (0.7 - lead - t) % 1.0 <= 0.3 + 1e-9 for t in locked), target.name
        assert 39 <= len(locked) <= 41  # 40 intervals: one poll each, the lock adds none


def test_a_new_target_is_polled_at_once_and_a_removed_one_forgotten():
    timetable = Timetable(ScrapeClock())
    kept, removed, added = FakeTarget("kept"), FakeTarget("removed"), FakeTarget("added")
    assert timetable.due([kept, removed], 10.0, 10.25, 5.0) == [kept, removed]
    assert timetable.due([kept, added], 10.3, 10.55, 5.0) == [added]  # another list: a reload
    assert timetable.due([kept, added, removed], 10.6, 10.85, 5.0) == [removed]  # forgotten: new again


def test_the_earliest_start_is_a_listed_targets():
    """A removed target's start, earlier than every listed one's, is not the loop's next wake-up."""
    timetable = Timetable(ScrapeClock())
    first, second = sorted((FakeTarget(f"t{i}") for i in range(2)), key=lambda t: phase_of(t.name))
    timetable.due([first, second], 0.0, 0.0, 5.0)
    starts = {t.name: 5.0 * (0.75 + (phase_of(t.name) - 0.75) % 1.0) for t in (first, second)}  # phase.next_start
    assert timetable.earliest() == pytest.approx(starts[first.name])
    assert timetable.due([second], 1.0, 1.0, 5.0) == []
    assert timetable.earliest() == pytest.approx(starts[second.name])
    assert timetable.due([second], starts[second.name], starts[second.name], 5.0) == [second]


def test_a_suspended_process_resumes_with_one_poll_each():
    timetable = Timetable(ScrapeClock())
    targets = [FakeTarget(f"t{i}") for i in range(20)]
    timetable.due(targets, 0.0, 0.25, 1.0)
    assert len(timetable.due(targets, 60.0, 60.25, 1.0)) == 20  # a minute later: everyone once
    assert timetable.due(targets, 60.25, 60.5, 1.0) == []  # and nobody again a tick later


def test_a_hanging_target_is_skipped_while_the_others_go_on():
    healthy = [FakeTarget(f"t{i}") for i in range(10)]
    stuck = FakeTarget("stuck", hang_seconds=3600)
    scheduler = Scheduler(healthy + [stuck], interval=0.2)
    scheduler.start()
    try:
        harness.wait_until(lambda: min(t.polls for t in healthy) >= 3, 30, what="three polls of each healthy target")
        assert stuck.polls == 1  # never started again while its poll hangs
    finally:
        scheduler.stop()
    assert stuck.cancelled == 1  # the hanging poll is cancelled, not waited for (it would take an hour)
    assert all(t.closed == 1 for t in healthy + [stuck])


class StartRecordingTarget(FakeTarget):
    def __init__(self, name: str):
        super().__init__(name)
        self.starts: list[float] = []

    async def poll(self) -> None:
        self.starts.append(time.monotonic())


def test_a_locked_loop_starts_each_poll_on_time_not_a_tick_early():
    """Locked, the loop wakes for each poll's own time: a poll (of no duration, so its lead is the margin
    and its place in a spread of a few ms) starts at most LOCKED_BATCH early, where a quarter-second tick
    would start it up to 0.25 s early and age the data the scrape reads by as much."""
    targets = [StartRecordingTarget(f"t{i}") for i in range(5)]
    scheduler = Scheduler(targets, interval=1.0)
    scraper = "10.0.0.9 Prometheus/3.0"
    first = time.monotonic() + 0.3 - phase.HISTORY  # a scraper every second, HISTORY scrapes so far

    async def scrape_at(at: float) -> None:
        scheduler.scrapes.observe(scraper, at, True)

    scrapes = [first + i for i in range(phase.HISTORY + 6)]
    scheduler.start()
    try:
        for at in scrapes[:phase.HISTORY]:
            scheduler.run(scrape_at(at))
        for at in scrapes[phase.HISTORY:]:
            time.sleep(max(at - time.monotonic(), 0.0))
            scheduler.run(scrape_at(at))
    finally:
        scheduler.stop()
    assert scheduler.scrapes.locked is not None
    ahead = phase.margin(1.0) + scheduler.timetable.spread + scheduler_module.LOCKED_BATCH + 0.005
    for target in targets:
        # The last three polls (the lock was fitted a wake after the seeded scrapes; one poll at the
        # target's own phase may come first): each its lead before a scrape, never more than a batch early.
        assert len(target.starts) >= 5, target.name
        for start in target.starts[-3:]:
            scrape = min(at for at in scrapes if at > start)
            assert scrape - start <= ahead, (target.name, scrape - start)


def test_a_scheduler_with_no_targets_runs_work_given_from_another_thread():
    scheduler = Scheduler([], interval=0.2)
    scheduler.start()
    try:
        probed = FakeTarget("probed")
        scheduler.run(probed.poll())
        assert probed.polls == 1
    finally:
        scheduler.stop()


def test_every_target_has_one_worker_and_the_shares_are_even():
    names = [f"engine-{i}.llama.svc:8000" for i in range(2000)]
    for workers in (2, 3):
        shares = Counter(owner(name, 1, workers) for name in names)
        assert set(shares) == {(0, worker) for worker in range(workers)}
        assert max(shares.values()) - min(shares.values()) < 0.1 * len(names) / workers  # hashed, not counted off
    assert {owner(name, 1) for name in names} == {(0, 0)}


@pytest.mark.parametrize("replicas, workers", [(1, 1), (2, 1), (3, 2), (4, 3)])
def test_replicas_of_one_configuration_and_their_workers_poll_every_target_once(replicas, workers):
    """Each process of each replica asks polled_by; every name must be claimed by exactly one of them, and
    every process must get about its even share (a replica's workers split the replica's share, not the names
    the replica already left to the others)."""
    names = [f"engine-{i}.llama.svc:8000" for i in range(3000)]
    claims = Counter()
    for index in range(replicas):
        config = Config(targets=(), shard=(index, replicas))
        for worker in range(workers):
            polls = polled_by(config, worker, workers)
            claims.update({(index, worker): sum(map(polls, names))})
    assert sum(claims.values()) == len(names)
    even = len(names) / (replicas * workers)
    assert len(claims) == replicas * workers and all(abs(count - even) < 0.15 * even for count in claims.values())
    every = [sum(polled_by(Config(targets=(), shard=(i, replicas)), w, workers)(name)
                 for i in range(replicas) for w in range(workers)) for name in names]
    assert set(every) == {1}
