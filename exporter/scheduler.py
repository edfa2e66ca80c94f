"""Polls every target on a fixed cadence, concurrently; a slow target never delays the others."""

from __future__ import annotations

import logging
import queue
import threading
import time

from .target import Target

log = logging.getLogger(__name__)
# Up to this many polls hang (each for at most the timeout) before a healthy target waits for a
# worker. More threads cost every poll: at 256 the GIL hand-offs took a fifth of the exporter's
# CPU at 2,000 targets, at 16 they were gone (bench/, docs/performance.md).
MAX_WORKERS = 64


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

    def submit(self, job, done: threading.Event) -> None:
        self._jobs.put((job, done))

    def _work(self) -> None:
        while True:
            job, done = self._jobs.get()
            try:
                job()
            finally:
                done.set()


def pool_size(targets: int) -> int:
    return max(1, min(targets, MAX_WORKERS))


class Scheduler:
    def __init__(self, targets: list[Target], interval: float):
        self.targets = list(targets)
        self.interval = interval
        self.ready = threading.Event()
        self._stop = threading.Event()
        self._in_flight: dict[str, threading.Event] = {}
        self._pool = WorkerPool(pool_size(len(targets)))
        self._thread = threading.Thread(target=self._run, name="scheduler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def replace_targets(self, targets: list[Target]) -> None:
        """Poll these from the next cycle on (a reload); a target object kept keeps its state."""
        self._pool.grow(pool_size(len(targets)))
        self.targets = list(targets)

    def run_cycle(self) -> list[threading.Event]:
        """Start a poll of every target that is not still busy with the previous one."""
        started = []
        for target in self.targets:
            running = self._in_flight.get(target.name)
            if running is not None and not running.is_set():
                log.debug("target %s still polling; skipping this cycle", target.name)
                continue
            done = threading.Event()
            self._in_flight[target.name] = done
            self._pool.submit(target.poll, done)
            started.append(done)
        return started

    def _run(self) -> None:
        next_tick = time.monotonic()
        for done in self.run_cycle():
            while not done.wait(0.1):  # /ready means one full cycle is done
                if self._stop.is_set():
                    return
        self.ready.set()
        while True:
            next_tick += self.interval
            now = time.monotonic()
            if next_tick < now:  # fell behind (e.g. a suspended process): skip the missed ticks
                next_tick = now
            if self._stop.wait(next_tick - now):
                return
            self.run_cycle()
