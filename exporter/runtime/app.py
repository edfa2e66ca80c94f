"""Wires a Config into running parts: targets, the poll scheduler and the HTTP server, and swaps
configurations on reload."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
import threading
import time
from dataclasses import replace
from typing import Awaitable, Callable

from .. import __version__, adapters, contract, exposition
from ..config import Config, ConfigError
from ..sources import parser
from ..thresholds import DEFAULT, PUBLISHED, Thresholds
from . import collector, logs, process_series
from .probe import SCRAPE_TIMEOUT_HEADER, Prober
from .server import MetricsServer, Request, Response
from .shard import Shard, polled_by
from .webconfig import WebConfig
from .workers import Workers

log = logging.getLogger(__name__)


CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class ExporterState:
    """The exporter's own series: its version and the outcome of configuration reloads."""

    def __init__(self) -> None:
        self.reload_ok = True
        self.reload_time = time.time()

    def reload_succeeded(self) -> None:
        self.reload_ok, self.reload_time = True, time.time()

    def reload_failed(self) -> None:
        self.reload_ok = False

    def lines(self, probed_targets: int, probe_evictions: int, scrape_interval: float = 0.0,
              phase_locked: bool = False, lead_ratio: float = 0.0, workers: Workers | None = None,
              groups_off: frozenset[str] = frozenset(), thresholds: Thresholds = DEFAULT) -> dict[str, str]:
        """Its series by family: one line each, for every family of the contract's `exporter` group."""
        values = {
            "exporter_build_info": (exposition.label_text({"version": __version__, "reader": parser.READER,
                                                            "adapter": adapters.ADAPTER}), 1.0),
            "exporter_config_last_reload_successful": ("", float(self.reload_ok)),
            "exporter_config_last_reload_success_timestamp_seconds": ("", self.reload_time),
            "exporter_probed_targets": ("", float(probed_targets)),
            "exporter_probe_evictions_total": ("", float(probe_evictions)),
            "exporter_poll_phase_locked": ("", float(phase_locked)),
            "exporter_scrape_interval_seconds": ("", scrape_interval),
            "exporter_poll_lead_ratio": ("", lead_ratio),
            "exporter_workers": ("", float(workers.count if workers else 1)),
            "exporter_worker_restarts_total": ("", float(workers.restarts if workers else 0)),
            "exporter_worker_missed_replies_total": ("", float(workers.missed if workers else 0)),
        }
        lines = {name: exposition.line(contract.FAMILIES[name].metric, labels, value)
                 for name, (labels, value) in values.items()}
        threshold = contract.FAMILIES["exporter_pressure_threshold"].metric
        lines["exporter_pressure_threshold"] = "".join(
            exposition.line(threshold, f'name="{name}"', float(getattr(thresholds, name))) for name in PUBLISHED)
        enabled = contract.FAMILIES["exporter_group_enabled"].metric
        lines["exporter_group_enabled"] = "".join(
            exposition.line(enabled, f'group="{group}"', float(group not in groups_off))
            for group in contract.OPTIONAL_GROUPS)
        return lines


# What a reload reads: the configuration and the web configuration (None: no --web.config.file), each with the
# files it names. Raises ConfigError.
Loader = Callable[[], tuple[Config, WebConfig | None]]


class Exporter:
    def __init__(self, config: Config, reload_config: Loader | None = None, web: WebConfig | None = None):
        self.config = config
        self._reload_config = reload_config
        self._reload_lock = threading.Lock()
        self.state = ExporterState()
        # With workers, they poll the targets and this process serves them (and /probe) from its loop.
        self.workers = Workers(config.workers) if config.workers > 1 else None
        self.shard = Shard(config, polls=polled_by(config) if self.workers is None else (lambda name: False))
        self.scheduler = self.shard.scheduler
        self.server = MetricsServer(config.listen, {
            ("GET", "/metrics"): self._metrics,
            ("GET", "/probe"): self._probe,
            ("GET", "/healthz"): _static(b"ok\n"),
            ("GET", "/ready"): self._ready,
            ("POST", "/-/reload"): self._reload_route,
            ("GET", "/"): _static(b"kvcache-exporter: /metrics, /probe?target=URL, /healthz, /ready\n"),
        }, web, scrapes=self.scheduler.scrapes)
        self.prober = Prober(lambda: self.config, lambda: self.server.port)

    def start(self) -> None:
        """Raises OSError if the listen address cannot be bound (before anything else has started)."""
        self.server.bind()
        self.shard.start()
        if self.workers is not None:
            self.scheduler.run(self.workers.start(self.config))
        self.scheduler.run(self.server.serve())
        share = (f" (shard {self.config.shard}: of the {len(self.config.targets)} configured, "
                 "those whose name hashes to it)")
        log.info("kvcache-exporter listening on %s, polling %d target(s) every %gs%s%s",
                 self.config.listen, sum(map(polled_by(self.config), (t.name for t in self.config.targets))),
                 self.config.poll_interval,
                 f" in {self.config.workers} worker processes" if self.workers is not None else "",
                 share if self.config.shard.count > 1 else "")
        if not self.config.targets:
            log.warning("no targets configured (--target, %s or a --config file): %s",
                        "KVCACHE_EXPORTER_TARGETS", "serving /probe only" if self.config.probe.enabled
                        else "nothing to serve, and probe mode is off (probe.enabled in a --config file)")

    def stop(self) -> None:
        if self.scheduler.running:  # the HTTP server first: no probe may reach the poll loop once it is closed
            self.scheduler.run(self._close_endpoint())
        else:
            self.server.close_socket()
        self.shard.stop()

    async def _close_endpoint(self) -> None:
        await self.server.close()
        await self.prober.close()
        if self.workers is not None:
            await self.workers.close()
        await self.shard.close()

    async def _ready(self, _: Request) -> Response:
        """Ready: every configured target has been polled at least once and the last poll of at least
        one of them succeeded. With no targets configured (probe mode only), ready at once."""
        shares = [self.shard.readiness()]
        if self.workers is not None:
            shares += await self.workers.readiness(self.config.timeout)
            if None in shares:
                return Response(503, b"not ready: a worker process did not answer\n")
        targets = sum(share.targets for share in shares)
        unpolled = sum(share.unpolled for share in shares)
        if unpolled:
            return Response(503, f"not ready: {unpolled} of {targets} target(s) not polled yet\n".encode())
        if targets and not any(share.up for share in shares):
            return Response(503, f"not ready: the last poll of every target ({targets}) failed\n".encode())
        return Response(200, b"ready\n")

    async def _metrics(self, request: Request) -> Response:
        texts = self.shard.texts()  # in the loop: streams change in it
        phase_state = self.scheduler.phase_state()
        if self.workers is not None:
            # The workers time their polls by the scrapes this process's clock sees: GET, not HEAD.
            seen = (request.client, request.arrived, SCRAPE_TIMEOUT_HEADER in request.headers)
            texts += await self.workers.scrape(seen if request.method == "GET" else None, self.config.timeout)
            phase_state = self.workers.phase_state()
        own = self.state.lines(self.prober.probed(), self.prober.evictions, *phase_state, self.workers,
                               self.config.groups_off, self.config.thresholds)
        # Joining every target's text takes milliseconds at a large fleet, and the process series read /proc: in a
        # worker thread, not the poll loop.
        body = await asyncio.to_thread(
            lambda: exposition.render(texts, time.time(), self.config.staleness, own | process_series.lines(),
                                      self.config.hidden_families))
        return Response(200, body, CONTENT_TYPE)

    async def _probe(self, request: Request) -> Response:
        status, probed = await self.prober.probe(request.query, request.headers)
        if status != 200:
            return Response(status, probed.encode() + b"\n")
        return Response(200, exposition.render([probed.text], time.time(), self.config.staleness,
                                               hidden=self.config.hidden_families), CONTENT_TYPE)

    async def _reload_route(self, _: Request) -> Response:
        ok, message = await asyncio.to_thread(self.reload)  # reads files: not in the poll loop
        return Response(200 if ok else 500, message.encode() + b"\n")

    def reload(self) -> tuple[bool, str]:
        """Re-read the configuration and the web configuration; on any problem keep the running ones and say why."""
        if self._reload_config is None:
            return False, "nothing to reload: no configuration file"
        with self._reload_lock:
            try:
                config, web = self._reload_config()
                self._apply(config, web)
            except ConfigError as err:
                return self._reload_failed(str(err))
            except Exception as err:  # the last resort: a fault of ours fails the reload, never ends the process
                log.exception("reload: unexpected error")
                return self._reload_failed(f"unexpected error: {type(err).__name__}: {err}")
            self.state.reload_succeeded()
            log.info("configuration reloaded: %d target(s)", len(config.targets))
            return True, "reloaded"

    def _reload_failed(self, reason: str) -> tuple[bool, str]:
        self.state.reload_failed()
        log.error("reload failed, keeping the running configuration: %s", reason)
        return False, f"reload failed: {reason}"

    def _apply(self, config: Config, web: WebConfig | None) -> None:
        """Every file the configurations name was read at load, so building its targets cannot fail on a file;
        the shard builds its new targets before it changes a running one. A new web configuration serves the
        next connection (a renewed certificate, other users or headers)."""
        for key in ("listen", "workers", "shard"):
            if getattr(config, key) != getattr(self.config, key):
                log.warning("%s changes only at restart; still %s", key, getattr(self.config, key))
                config = replace(config, **{key: getattr(self.config, key)})
        if web is not None and (web.tls is None) != (self.server.web.tls is None):
            # A scraper's scheme is its own configuration: the endpoint does not switch it under Prometheus.
            log.warning("TLS on or off changes only at restart; still %s", "on" if web.tls is None else "off")
            web.tls = self.server.web.tls
        self.shard.apply(config)
        if web is not None:
            self.server.web = web
        self.config = config
        if self.workers is not None and self.scheduler.running:
            self.scheduler.run(self.workers.apply(config))


def _static(body: bytes) -> Callable[[Request], Awaitable[Response]]:
    async def route(_: Request) -> Response:
        return Response(200, body)

    return route


def serve(config: Config, listen_key: tuple[str, str], reload_config: Loader | None = None,
          web: WebConfig | None = None, on_listening=None) -> int:
    """Run until SIGTERM or SIGINT; SIGHUP reloads the configuration and web configuration files. `listen_key` is
    (where, key) of the listen address, named if it cannot be bound; `on_listening` runs once it is bound."""
    logs.configure(config.log_level, config.log_format)
    # Before the port is bound: a SIGTERM as soon as /ready answers must stop the exporter cleanly, not kill it.
    stop, hangup = threading.Event(), threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    signal.signal(signal.SIGHUP, lambda *_: hangup.set())
    exporter = Exporter(config, reload_config, web)
    try:
        exporter.start()
    except OSError as err:
        exporter.stop()
        problem = f"cannot listen on {config.listen}: {err.strerror or err}"
        print(f"kvcache-exporter: {ConfigError(*listen_key, problem)}", file=sys.stderr)
        return 2
    if on_listening is not None:
        on_listening()
    collector.tune()
    while not stop.wait(0.2):
        if hangup.is_set():
            hangup.clear()
            exporter.reload()
    exporter.stop()
    return 0
