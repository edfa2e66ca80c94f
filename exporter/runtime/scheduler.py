"""Polls every target once per interval from one asyncio event loop; a slow target never delays the others.

One thread runs every poll: the fetches wait concurrently, and the reading of each page (parse,
adapt, derive, render) runs whole as its response arrives. Poll threads (64 of them, in an earlier
design) spent more CPU handing the GIL to each other than on the polls: futex calls by the
hundred per poll (docs/performance.md). On its own cadence each target keeps a fixed phase within
the interval, from a hash of its name, as Prometheus spreads its scrapes: the polls of a large fleet
arrive in small batches over the interval instead of as one burst at its start, and a scrape of
/metrics (served in this loop, rendered in a worker thread) never waits behind a burst. Once a
scraper of /metrics comes regularly (exporter/runtime/phase.py), each target's poll is timed to
complete just before its next scrape instead: the same cadence, another phase.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from typing import Awaitable, Iterable, TypeVar

from . import phase
from .target import Target

log = logging.getLogger(__name__)
# The scheduler wakes every TICK seconds (a quarter of the interval if that is shorter) and starts
# the polls due before its next wake-up: their pages are then read back to back, while the
# interpreter's caches are warm. Shorter ticks cost more CPU per poll, longer ones no less
# (bench/tick.py, docs/performance.md).
TICK = 0.25
# Locked to a scraper, the loop wakes when the next poll is due and starts those due within this much:
# a poll started early ages the data the scrape reads by as much, so the tick's batching would spend
# the lock's gain (a quarter second at worst). At most 1/LOCKED_BATCH wake-ups a second.
LOCKED_BATCH = 0.02
T = TypeVar("T")


class Scheduler:
    def __init__(self, targets: list[Target], interval: float):
        self.interval = interval
        self.scrapes = phase.ScrapeClock()  # fed by the HTTP server, read by the loop: both in the loop's thread
        self._loop = asyncio.new_event_loop()
        self._stopping = False
        self._nap: asyncio.Future | None = None  # the loop's wait for its next wake-up, cut short by stop()
        self._busy: set[str] = set()  # targets with a poll running
        self._tasks: set[asyncio.Task] = set()
        self.timetable = phase.Timetable(self.scrapes)
        self._cpu: deque[tuple[float, float]] = deque()  # (monotonic, the loop thread's CPU seconds) per tick
        self.replace_targets(targets)
        self._thread = threading.Thread(target=self._main, name="poll-loop", daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def stop(self) -> None:
        """Cancel the polls running, close every target's connection, and end the loop."""
        self._stopping = True
        if self._thread.is_alive():
            try:  # now, not at the next tick: a stop is due at once
                self._loop.call_soon_threadsafe(self._wake)
            except RuntimeError:  # the loop ended meanwhile
                pass
            self._thread.join()
        elif not self._loop.is_closed():  # never started
            self._loop.close()

    def replace_targets(self, targets: list[Target]) -> None:
        """Poll these from now on (a reload); a target kept keeps its state and its timing, a new one is
        polled at the next tick."""
        self.targets = list(targets)

    def discard(self, targets: Iterable[Target]) -> None:
        """Close these targets' connections, in the loop that owns them."""
        targets = list(targets)
        if targets and self._thread.is_alive():
            self._loop.call_soon_threadsafe(lambda: [target.close() for target in targets])

    def run(self, work: Awaitable[T]) -> T:
        """Run `work` in the loop and wait for it, from another thread."""
        return asyncio.run_coroutine_threadsafe(work, self._loop).result()

    def phase_state(self) -> tuple[float, bool, float]:
        """(the measured interval of the scraper locked to, or of the one it would be, 0 if none; locked?; the
        polls' largest lead over the poll interval)"""
        return (self.scrapes.seen_interval, self.scrapes.locked is not None,
                self.timetable.largest_lead(self.interval) / self.interval)

    def _main(self) -> None:
        try:
            self._loop.run_until_complete(self._run())
        finally:
            self._loop.close()

    def _start_polls(self, targets: list[Target]) -> None:
        for target in targets:
            if target.name in self._busy:
                log.debug("target %s still polling; skipping this round", target.name)
                continue
            self._busy.add(target.name)
            task = self._loop.create_task(self._poll(target))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _poll(self, target: Target) -> None:
        started = time.monotonic()
        try:
            await target.poll()
        finally:
            self._busy.discard(target.name)
            self.timetable.finished(target.name, time.monotonic() - started)

    def _wake(self) -> None:
        if self._nap is not None and not self._nap.done():
            self._nap.set_result(None)

    def _measure_cpu(self, now: float) -> None:
        """The loop thread's CPU over the last interval or so: how long the fleet's polls keep it busy."""
        self._cpu.append((now, time.thread_time()))
        while len(self._cpu) > 2 and now - self._cpu[1][0] >= self.interval:
            self._cpu.popleft()
        (first, cpu_first), (last, cpu_last) = self._cpu[0], self._cpu[-1]
        busy = (cpu_last - cpu_first) / (last - first) * self.interval if last > first else 0.0
        self.timetable.spread = phase.spread_window(busy, self.interval)

    async def _run(self) -> None:
        try:
            while not self._stopping:
                tick = min(TICK, self.interval / 4)
                now = time.monotonic()
                self._measure_cpu(now)
                locked = self.scrapes.update(self.interval, now) is not None
                # A poll due before the next wake-up starts now: at most a tick (locked: a batch) early, never late.
                batch = min(tick, LOCKED_BATCH) if locked else tick
                due = self.timetable.due(self.targets, now, now + batch, self.interval)
                if due:
                    self._start_polls(due)
                wake = min(self.timetable.earliest(), now + tick) if locked else now + tick
                self._nap = self._loop.create_future()
                timer = self._loop.call_later(max(wake - time.monotonic(), 0.001), self._wake)
                await self._nap
                timer.cancel()
        finally:
            for task in self._tasks:
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            for target in self.targets:
                target.close()
            await asyncio.sleep(0)  # the transports close in the next turn of the loop
