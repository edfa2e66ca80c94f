"""The targets one process polls: their poll loop, their KV event streams, and what a reload keeps.

One exporter process polls every configured target (`workers: 1`, the default); with more workers,
each worker process polls the targets whose name hashes to it and the parent polls none
(exporter/runtime/workers.py). Replicas given one configuration and `shard: INDEX/COUNT` each poll the
targets whose name hashes to their index, and split that share over their own workers (`owner`).
Either way the poll loop's thread also runs whatever else the process serves (the HTTP server, /probe).
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from typing import Callable

from .. import exposition
from ..config import Config, TargetConfig
from .scheduler import Scheduler
from .subscriber import Subscribers
from .target import fetch_settings, new_target


def owner(name: str, replicas: int, workers: int = 1) -> tuple[int, int]:
    """(replica, worker) that polls target `name`: the same after every restart and reload. The replica is the
    name's hash modulo the replicas, the worker the quotient's modulo the workers, so that every worker of a
    replica gets a share of it."""
    digest = int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "big")
    return digest % replicas, digest // replicas % workers


def polled_by(config: Config, worker: int = 0, workers: int = 1) -> Callable[[str], bool]:
    """Whether worker `worker` of `workers` (the process itself: 0 of 1) of this replica polls a target."""
    index, replicas = config.shard
    return lambda name: owner(name, replicas, workers) == (index, worker)


@dataclass(frozen=True)
class Readiness:
    targets: int
    unpolled: int  # not polled yet
    up: int  # whose last poll succeeded


class Shard:
    def __init__(self, config: Config, polls: Callable[[str], bool] = lambda name: True):
        """`polls(name)`: whether this process polls the configured target `name`."""
        self.config = config
        self._polls = polls
        self.targets = [new_target(t, config) for t in config.targets if polls(t.name)]
        self.scheduler = Scheduler(self.targets, config.poll_interval)
        self.subscribers = Subscribers()  # the targets' KV event streams, in the scheduler's loop

    def start(self) -> None:
        self.scheduler.start()
        self.scheduler.run(self.subscribers.replace(self.targets, self.config.fleet_index, self.config.labels))

    async def close(self) -> None:
        """In the loop, before `stop`."""
        await self.subscribers.close()

    def stop(self) -> None:
        self.scheduler.stop()

    def texts(self) -> list[exposition.TargetText]:
        """Every target's text and every stream's; in the loop, where the streams change."""
        return [t.text for t in self.targets] + self.subscribers.render(time.monotonic(), self.config.poll_interval)

    def readiness(self) -> Readiness:
        targets = self.targets
        return Readiness(len(targets), sum(t.outcome.duration is None for t in targets),
                         sum(t.outcome.up for t in targets))

    def apply(self, config: Config) -> None:
        """A reload: a target polled the same way keeps its series, history and failure counts."""
        kept = {_identity(self.config, t.config): t for t in self.targets}
        plan = [(target_config, kept.pop(_identity(config, target_config), None))
                for target_config in config.targets if self._polls(target_config.name)]
        # The new targets first: one that cannot be built raises before any running target has changed.
        targets = [new_target(target_config, config) if target is None else target for target_config, target in plan]
        for target_config, target in plan:
            if target is not None:
                target.update(target_config, config.thresholds, config.labels, config.adapted_buckets)
        self.config = config
        self.targets = targets
        self.scheduler.interval = config.poll_interval
        self.scheduler.replace_targets(targets)
        self.scheduler.discard(kept.values())
        if self.scheduler.running:
            self.scheduler.run(self.subscribers.replace(targets, config.fleet_index, config.labels))


def _identity(config: Config, target: TargetConfig) -> tuple:
    """What makes a reloaded target the same one: its name, engine and how it is fetched."""
    return target.name, target.engine, target.url, fetch_settings(config, target)
