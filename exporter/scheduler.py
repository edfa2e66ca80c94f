"""Polls every target once per interval, concurrently; a slow target never delays the others.

Each target keeps a fixed phase within the interval, from a hash of its name, as Prometheus spreads
its scrapes: the polls of a large fleet arrive evenly over the interval instead of as one burst at
its start. A burst puts every poll thread in the run queue at once, and the GIL hand-offs between
them cost more CPU than the polls themselves once the threads number in the dozens (bench/,
docs/performance.md); spread out, a poll rarely finds another one running.
"""

from __future__ import annotations

import bisect
import hashlib
import logging
import queue
import threading
import time

from .target import Target

log = logging.getLogger(__name__)
# Up to this many polls hang (each for at most the timeout) before a healthy target waits for a worker.
MAX_WORKERS = 64
# The scheduler sleeps until the next phase due, at most MAX_SLEEP (to see the stop flag and reloads)
# and at least MIN_SLEEP: polls due within it start together, rather than one wake-up per poll.
MAX_SLEEP = 0.25
MIN_SLEEP = 0.01


class WorkerPool:
    """Daemon threads taking polls from a queue: a poll still hanging at shutdown never delays the exit."""

    def __init__(self, size: int):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._size = 0
        self.grow(size)

    def grow(self, size: int) -> None:
        while self._size < size:
            threading.Thread(target=self._work, name=f"poll-{self._size}", daemon=True).start()
            self._size += 1

    def submit(self, job, *args) -> None:
        self._jobs.put((job, args))

    def _work(self) -> None:
        while True:
            job, args = self._jobs.get()
            job(*args)


def pool_size(targets: int) -> int:
    return max(1, min(targets, MAX_WORKERS))


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

    def next_after(self, position: float) -> float:
        """Intervals from `position` (in intervals since the epoch) to the next phase of any target."""
        if not self.phases:
            return 1.0
        offset = position % 1.0
        index = bisect.bisect_right(self.phases, offset)
        following = self.phases[index] if index < len(self.phases) else self.phases[0] + 1.0
        return following - offset


class Scheduler:
    def __init__(self, targets: list[Target], interval: float):
        self.interval = interval
        self.ready = threading.Event()
        self._stop = threading.Event()
        self._busy: set[str] = set()  # targets with a poll queued or running
        self._first_round_left = 0
        self._lock = threading.Lock()
        self._pool = WorkerPool(pool_size(len(targets)))
        self.replace_targets(targets)
        self._thread = threading.Thread(target=self._run, name="scheduler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def replace_targets(self, targets: list[Target]) -> None:
        """Poll these from now on (a reload); a target object kept keeps its state and its phase."""
        self._pool.grow(pool_size(len(targets)))
        self.targets = list(targets)
        self._phases = Phases(self.targets)

    def _start_polls(self, targets: list[Target], first_round: bool = False) -> None:
        for target in targets:
            if target.name in self._busy:
                log.debug("target %s still polling; skipping this round", target.name)
                continue
            self._busy.add(target.name)
            self._pool.submit(self._poll, target, first_round)

    def _poll(self, target: Target, first_round: bool) -> None:
        try:
            target.poll()
        finally:
            self._busy.discard(target.name)
            if first_round:
                with self._lock:
                    self._first_round_left -= 1
                    if self._first_round_left == 0:
                        self.ready.set()

    def _run(self) -> None:
        # Everyone once at the start (/ready means that round is done), then each target at its phase.
        self._first_round_left = len(self.targets)
        if not self.targets:
            self.ready.set()
        self._start_polls(self.targets, first_round=True)
        position = 0.0  # intervals since the start, up to which polls have been started
        clock = time.monotonic()
        while True:
            phases, interval = self._phases, self.interval
            sleep = min(max(phases.next_after(position) * interval, MIN_SLEEP), MAX_SLEEP)
            if self._stop.wait(sleep):
                return
            # Counted in intervals, step by step, so that a reload changing the interval moves no phase.
            now = time.monotonic()
            following = position + (now - clock) / interval
            clock = now
            if following > 1.0:  # the first round stood for the first interval
                self._start_polls(phases.due(max(position, 1.0), following))
            position = following
