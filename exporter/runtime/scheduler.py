"""Polls every target once per interval from one asyncio event loop; a slow target never delays the others.

One thread runs every poll: the fetches wait concurrently, and the reading of each page (parse,
adapt, derive, render) runs whole as its response arrives. Poll threads (64 of them, in an earlier
design) spent more CPU handing the GIL to each other than on the polls: futex calls by the
hundred per poll (docs/performance.md). Each target keeps a fixed phase within the interval, from
a hash of its name, as Prometheus spreads its scrapes: the polls of a large fleet arrive in small
batches over the interval instead of as one burst at its start, and a scrape of /metrics (served
in this loop, rendered in a worker thread) never waits behind a burst.
"""

from __future__ import annotations

import asyncio
import bisect
import hashlib
import logging
import threading
import time
from typing import Awaitable, Iterable, TypeVar

from .target import Target

log = logging.getLogger(__name__)
# The scheduler wakes every TICK seconds (a quarter of the interval if that is shorter) and starts
# the polls whose phase has come: their pages are then read back to back, while the interpreter's
# caches are warm. Shorter ticks cost more CPU per poll, longer ones no less (bench/tick.py,
# docs/performance.md).
TICK = 0.25
T = TypeVar("T")


def phase_of(name: str) -> float:
    """Where in the interval a target is polled, as a fraction of it: stable across restarts and reloads."""
    digest = hashlib.blake2b(name.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64


class Phases:
    """Targets sorted by phase, and which of them fall due between two instants."""

    def __init__(self, targets: list[Target]):
        pairs = sorted(((phase_of(t.name), i) for i, t in enumerate(targets)))
        self.phases = [phase for phase, _ in pairs]
        self.targets = [targets[i] for _, i in pairs]

    def due(self, start: float, end: float) -> list[Target]:
        """Targets with a phase in (start, end], both in intervals since the epoch (a whole interval or
        more gives every target once: a process that was suspended catches up with one poll each)."""
        if end - start >= 1.0:
            return list(self.targets)
        low, high = start % 1.0, end % 1.0
        first, last = bisect.bisect_right(self.phases, low), bisect.bisect_right(self.phases, high)
        if low <= high:
            return self.targets[first:last]
        return self.targets[first:] + self.targets[:last]


class Scheduler:
    def __init__(self, targets: list[Target], interval: float):
        self.interval = interval
        self._loop = asyncio.new_event_loop()
        self._stopping = False
        self._busy: set[str] = set()  # targets with a poll running
        self._tasks: set[asyncio.Task] = set()
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
            self._thread.join()
        elif not self._loop.is_closed():  # never started
            self._loop.close()

    def replace_targets(self, targets: list[Target]) -> None:
        """Poll these from now on (a reload); a target object kept keeps its state and its phase."""
        self.targets = list(targets)
        self._phases = Phases(self.targets)

    def discard(self, targets: Iterable[Target]) -> None:
        """Close these targets' connections, in the loop that owns them."""
        targets = list(targets)
        if targets and self._thread.is_alive():
            self._loop.call_soon_threadsafe(lambda: [target.close() for target in targets])

    def run(self, work: Awaitable[T]) -> T:
        """Run `work` in the loop and wait for it, from another thread."""
        return asyncio.run_coroutine_threadsafe(work, self._loop).result()

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
        try:
            await target.poll()
        finally:
            self._busy.discard(target.name)

    async def _run(self) -> None:
        # Everyone once at the start, then each target at its phase.
        self._start_polls(self.targets)
        position = 0.0  # intervals since the start, up to which polls have been started
        clock = time.monotonic()
        try:
            while not self._stopping:
                await asyncio.sleep(min(TICK, self.interval / 4))
                # Counted in intervals, step by step, so that a reload changing the interval moves no phase.
                now = time.monotonic()
                following = position + (now - clock) / self.interval
                clock = now
                if following > 1.0 and not self._stopping:  # the first round stood for the first interval
                    self._start_polls(self._phases.due(max(position, 1.0), following))
                position = following
        finally:
            for task in self._tasks:
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            for target in self.targets:
                target.close()
            await asyncio.sleep(0)  # the transports close in the next turn of the loop
