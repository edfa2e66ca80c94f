"""Polls every target on a fixed cadence, concurrently; a slow target never delays the others."""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

from .target import Target

log = logging.getLogger(__name__)
# Enough workers that a whole cycle of hanging targets (each bounded by the timeout) cannot starve the rest.
MAX_WORKERS = 256


class Scheduler:
    def __init__(self, targets: list[Target], interval: float):
        self.targets = targets
        self.interval = interval
        self.ready = threading.Event()
        self.cycles = 0
        self._stop = threading.Event()
        self._in_flight: dict[str, Future] = {}
        self._pool = ThreadPoolExecutor(max_workers=max(1, min(len(targets), MAX_WORKERS)),
                                        thread_name_prefix="poll")
        self._thread = threading.Thread(target=self._run, name="scheduler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self._pool.shutdown(wait=False, cancel_futures=True)
        for target in self.targets:
            target.close()

    def run_cycle(self) -> list[Future]:
        """Start a poll of every target that is not still busy with the previous one."""
        started = []
        for target in self.targets:
            running = self._in_flight.get(target.name)
            if running is not None and not running.done():
                log.debug("target %s still polling; skipping this cycle", target.name)
                continue
            future = self._pool.submit(target.poll)
            self._in_flight[target.name] = future
            started.append(future)
        self.cycles += 1
        return started

    def _run(self) -> None:
        next_tick = time.monotonic()
        first = self.run_cycle()
        for future in first:
            future.exception()  # wait: /ready means one full cycle is done
        self.ready.set()
        while True:
            next_tick += self.interval
            now = time.monotonic()
            if next_tick < now:  # fell behind (e.g. a suspended process): skip the missed ticks
                next_tick = now
            if self._stop.wait(next_tick - now):
                return
            self.run_cycle()
