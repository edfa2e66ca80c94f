"""Wires a Config into running parts: targets, the poll scheduler, the collector and the HTTP server."""

from __future__ import annotations

import logging
from dataclasses import replace

from prometheus_client import CollectorRegistry

from .collector import KVCacheCollector
from .config import Config
from .fetch import FetchSettings
from .scheduler import Scheduler
from .server import MetricsServer
from .target import Target

log = logging.getLogger(__name__)


class Exporter:
    def __init__(self, config: Config):
        self.config = config
        settings = FetchSettings(timeout=config.timeout, max_bytes=config.max_response_bytes)
        self.targets = [
            Target(t, _with_credentials(settings, t), config.thresholds, config.labels) for t in config.targets
        ]
        self.scheduler = Scheduler(self.targets, config.poll_interval)
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(KVCacheCollector(lambda: self.targets, config.staleness))
        self.server = MetricsServer(config.listen, self.registry, self.scheduler.ready.is_set)

    def start(self) -> None:
        self.server.start()
        self.scheduler.start()
        log.info("kvcache-exporter listening on %s, polling %d target(s) every %gs",
                 self.config.listen, len(self.targets), self.config.poll_interval)

    def stop(self) -> None:
        self.scheduler.stop()
        self.server.stop()


def _with_credentials(settings: FetchSettings, target) -> FetchSettings:
    return replace(settings, bearer_token_file=target.bearer_token_file, ca_file=target.ca_file)
