"""Probe mode (the multi-target exporter pattern): `/probe?target=URL&engine=auto` polls one engine
now. Each probed engine's Target is kept between probes, so derived series that need history
(pressure state, counter resets) work as in poll mode, and forgotten after the staleness period."""

from __future__ import annotations

import threading
import time
from typing import Callable

from .config import ENGINES, Config, TargetConfig, target_from_url
from .scheduler import Scheduler
from .target import Target


class Prober:
    def __init__(self, config: Callable[[], Config], make_target: Callable[[TargetConfig, Config], Target],
                 scheduler: Scheduler):
        self._config = config
        self._make_target = make_target
        self._scheduler = scheduler  # whose event loop polls the probed targets too
        self._lock = threading.Lock()
        self._targets: dict[tuple[str, str], tuple[Target, threading.Lock]] = {}
        self._last_probe: dict[tuple[str, str], float] = {}

    def probe(self, query: dict[str, list[str]], headers: dict[str, str]) -> tuple[int, Target | str]:
        url = (query.get("target") or [""])[0]
        engine = (query.get("engine") or ["auto"])[0]
        if engine not in ENGINES:
            return 400, f"engine must be one of {', '.join(ENGINES)}"
        try:
            target_config = target_from_url(url)
        except ValueError as err:
            return 400, f"target {err}"
        config = self._config()
        key = (url, engine)
        now = time.monotonic()
        with self._lock:
            stale = [k for k, last in self._last_probe.items() if now - last > config.staleness]
            self._scheduler.discard(self._targets.pop(k)[0] for k in stale)
            for k in stale:
                del self._last_probe[k]
            if key not in self._targets:
                target_config = TargetConfig(name=target_config.name, url=url, engine=engine)
                self._targets[key] = (self._make_target(target_config, config), threading.Lock())
            self._last_probe[key] = now
            target, lock = self._targets[key]
        with lock:  # two scrapes of one engine at once poll it once each, in turn
            self._scheduler.run(target.poll())
        return 200, target

    def probed(self) -> int:
        with self._lock:
            return len(self._targets)

    def forget_all(self) -> list[Target]:
        with self._lock:
            targets = [target for target, _ in self._targets.values()]
            self._targets.clear()
            self._last_probe.clear()
        return targets
