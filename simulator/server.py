"""Run a simulated engine in real time x speed and serve its /metrics over HTTP.

The model advances in a background thread and publishes an immutable `EngineState` after each
tick; scrapes (each in its own thread) render the latest published state, so a scrape never
blocks the model and the model never blocks a scrape. Several engines may run in one process.

A request for some series only (`?name[]=NAME`, prometheus_client's filter) is answered as the
engine answers it (NAME_FILTERS): vLLM's /metrics is prometheus-fastapi-instrumentator's route,
which ignores the query (vLLM 0.32: `Instrumentator.expose`, registered before the `make_asgi_app`
mount); SGLang and trtllm-serve mount prometheus_client's ASGI app on a multiprocess registry made
without `support_collectors_without_names`, which from prometheus_client 0.23 (the first whose ASGI
app reads the query) answers a filtered request with no series at all. `restrict` is prometheus_client
honouring it: the samples of the names asked for, with their families' HELP and TYPE (LMDeploy's
api_server on the default registry; SGLang or trtllm-serve with the registry prometheus_client 0.25's
documentation recommends).
"""

from __future__ import annotations

import gzip
import logging
import queue
import threading
import time
from collections import deque
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

from prometheus_client import CollectorRegistry, GCCollector, PlatformCollector
from prometheus_client.registry import RestrictedRegistry
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, generate_latest
from prometheus_client.openmetrics import exposition as openmetrics

from . import kvevents
from .exposition import FLAVORS, EngineState, Flavor
from .scenarios import ROUTERS, Scenario, ScenarioRun, load_scenario, override_engine

logger = logging.getLogger(__name__)

TICK_S = 0.05  # wall seconds between model advances
NAME_FILTERS = ("ignore", "empty", "restrict")  # how a request for some series only is answered (above)
ENGINE_NAME_FILTER = {"sglang": "empty", "trtllm": "empty"}  # by flavor; other flavors (vLLM) ignore it
MAX_WORK_PER_TICK_S = 0.25  # a model that falls behind still publishes this often


class SimulatedEngine:
    """A running simulated engine. Use `start_engine` to make one; stop it with `.stop()` or `with`."""

    def __init__(self, flavor: Flavor, scenario: Scenario, *, host: str, port: int, speed: float,
                 seed: int, model_name: str, tp: int, dp: int, kv_events_endpoint: str | None = None,
                 served_history: int = 0, name_filter: str = "ignore", router: str = ROUTERS[0]):
        self.flavor = flavor.name
        self.scenario = scenario
        self.speed = speed
        self.seed = seed
        self.model_name = model_name
        self.tp = tp
        self.kv_events_endpoint = kv_events_endpoint
        self._run = ScenarioRun(scenario, flavor.reporting, seed=seed, dp=dp,
                                record_kv_events=kv_events_endpoint is not None, router=router)
        # The prefix cache's stores and evictions on a ZMQ PUB per DP rank, as the engine's --kv-events-config
        self._events = kvevents.Publisher(kv_events_endpoint, dp) if kv_events_endpoint else None
        self._published_generation = 0
        self._started_monotonic = time.monotonic()
        self._started_unix = time.time()
        self._state = self._build_state()
        self._stopping = threading.Event()
        self._arrival_rates: queue.SimpleQueue[float] = queue.SimpleQueue()  # set_arrival_rate's, for the model thread

        # Collectors without names (the simulator's, the multiprocess one) take part in a filtered answer only
        # when the registry says so: prometheus_client answers no series from them otherwise.
        self.registry = CollectorRegistry(support_collectors_without_names=name_filter == "restrict")
        if flavor.python_collectors:
            GCCollector(registry=self.registry)
            PlatformCollector(registry=self.registry)
        # The states the last `served_history` scrapes rendered, each with the wall time it was read: what a
        # scraper saw, to set against what it reports (tests; 0 keeps none).
        self._served: deque[tuple[float, EngineState]] = deque(maxlen=served_history)
        self.registry.register(flavor.make_collector(self._serve if served_history else self.state, seed))

        self._http = ThreadingHTTPServer((host, port), _handler_for(self.registry, flavor.metrics_path, name_filter))
        self._http.daemon_threads = True
        self.host, self.port = self._http.server_address[:2]
        self.url = f"http://{self.host}:{self.port}{flavor.metrics_path}"
        self._threads = [
            threading.Thread(target=self._http.serve_forever, name=f"kvcache-sim-http-{self.port}", daemon=True),
            threading.Thread(target=self._advance_forever, name=f"kvcache-sim-model-{self.port}", daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    # -- public --------------------------------------------------------------------------

    @property
    def sim_time(self) -> float:
        """Simulated seconds since the engine started (as of the last published state)."""
        return self._state.ranks[0].now

    @property
    def restarts(self) -> int:
        return self._run.generation

    def state(self) -> EngineState:
        """The latest published state: what the next scrape renders."""
        return self._state

    def served(self) -> list[tuple[float, EngineState]]:
        """(wall time, state) of the last scrapes rendered, oldest first (with `served_history`)."""
        return list(self._served)

    def _serve(self) -> EngineState:
        state = self._state
        self._served.append((time.time(), state))
        return state

    def set_arrival_rate(self, rate: float) -> None:
        """Requests per simulated second from the model's next tick on (until the scenario's next phase): what a
        router sends this replica of a model."""
        self._arrival_rates.put(rate)

    def stop(self) -> None:
        if self._stopping.is_set():
            return
        self._stopping.set()
        self._http.shutdown()
        self._http.server_close()
        for thread in self._threads:
            thread.join()
        if self._events is not None:
            self._events.close()

    def __enter__(self) -> "SimulatedEngine":
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()

    # -- model thread --------------------------------------------------------------------

    def _advance_forever(self) -> None:
        while not self._stopping.wait(TICK_S):
            target = (time.monotonic() - self._started_monotonic) * self.speed
            deadline = time.monotonic() + MAX_WORK_PER_TICK_S
            while not self._arrival_rates.empty():
                self._run.set_arrival_rate(self._arrival_rates.get())
            # Small slices, so that a model far behind still publishes and notices stop().
            while self._run.now < target and time.monotonic() < deadline and not self._stopping.is_set():
                self._run.advance_to(min(target, self._run.now + TICK_S * self.speed))
            self._state = self._build_state()
            if self._events is not None:
                self._publish_kv_events()

    def _publish_kv_events(self) -> None:
        """Each step's stores and evictions as one batch, stamped with the step's simulated time."""
        signed = self.flavor in kvevents.SIGNED_HASHES
        block_size = self.scenario.engine.block_size
        restarted = self._run.generation != self._published_generation
        self._published_generation = self._run.generation
        for rank, model in enumerate(self._run.models):
            if restarted:  # the pool is empty again
                self._events.send(rank, kvevents.batch(self._started_unix + model.started_at, kvevents.CLEARED, rank))
            for ts, journal in model.kv_batches:
                self._events.send(rank, kvevents.batch(self._started_unix + ts,
                                                       kvevents.events(journal, block_size, signed), rank))
            model.kv_batches.clear()

    def _build_state(self) -> EngineState:
        generation_start = self._run.models[0].started_at
        return EngineState(
            model_name=self.model_name,
            tp=self.tp,
            created_unix=self._started_unix + generation_start / self.speed,
            ranks=tuple(model.snapshot() for model in self._run.models),
        )


def encode(registry: CollectorRegistry | RestrictedRegistry, accept: str) -> tuple[bytes, str]:
    """OpenMetrics when the client asks for it, else text 0.0.4: the engines' negotiation."""
    if "application/openmetrics-text" in accept:
        # With its default escaping, prometheus_client 0.26 rewrites the colons of OpenMetrics
        # sample names (not of HELP/TYPE) to underscores; the engines' clients keep them.
        body = openmetrics.generate_latest(registry, escaping=openmetrics.ALLOWUTF8)
        return body, openmetrics.CONTENT_TYPE_LATEST
    return generate_latest(registry), CONTENT_TYPE_PLAIN_0_0_4


def _handler_for(registry: CollectorRegistry, metrics_path: str,
                 name_filter: str = "ignore") -> type[BaseHTTPRequestHandler]:
    class MetricsHandler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            url = urlsplit(self.path)
            if url.path == metrics_path:
                # prometheus_client's own reading of the query (exposition._bake_output): `name[]`, repeated.
                names = parse_qs(url.query).get("name[]") if name_filter != "ignore" else None
                answered = registry.restricted_registry(names) if names else registry
                self._reply(200, *encode(answered, self.headers.get("Accept", "")))
            elif url.path == "/health":
                self._reply(200, b"", "text/plain; charset=utf-8")
            else:
                self._reply(404, b"Not Found\n", "text/plain; charset=utf-8")

        def _reply(self, status: int, body: bytes, content_type: str) -> None:
            compress = "gzip" in self.headers.get("Accept-Encoding", "") and body
            if compress:
                body = gzip.compress(body)
            try:
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                if compress:
                    self.send_header("Content-Encoding", "gzip")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
            except (BrokenPipeError, ConnectionResetError):  # the scraper's timeout ran out first: not an error here
                logger.debug("%s closed the connection before the reply", self.address_string())

        def log_message(self, format: str, *args) -> None:  # noqa: A002 (the base class's name)
            logger.debug("%s %s", self.address_string(), format % args)

    return MetricsHandler


def start_engine(flavor: str, scenario: str | Scenario = "steady", host: str = "127.0.0.1", port: int = 0,
                 speed: float = 1.0, seed: int = 0, model: str | None = None, tp: int = 1, dp: int = 1,
                 kv_events_endpoint: str | None = None, served_history: int = 0, name_filter: str | None = None,
                 router: str = ROUTERS[0], **overrides) -> SimulatedEngine:
    """Start a simulated engine serving GET /metrics and /health; returns once it is listening.

    `scenario` is a built-in name, a YAML file path or a `Scenario`; `overrides` replace fields
    of the scenario's engine sizing (`num_blocks=2048`, `max_num_seqs=8`, ...). `kv_events_endpoint`
    (tcp://HOST:PORT) publishes the prefix cache's KV events there, rank r on PORT + r. `router` (ROUTERS)
    dispatches the requests over the DP ranks. `served_history`
    keeps the states the last that many scrapes rendered (`SimulatedEngine.served`). `name_filter` (one of
    NAME_FILTERS) says how a request for some series only is answered; None: as the flavor's engine does. Raises
    ValueError (ScenarioError for scenario and override problems) on bad arguments.
    """
    if flavor not in FLAVORS:
        raise ValueError(f"unknown flavor {flavor!r} (known: {', '.join(FLAVORS)})")
    spec = FLAVORS[flavor]
    if not speed > 0:
        raise ValueError(f"speed must be > 0, got {speed!r}")
    if tp < 1 or dp < 1:
        raise ValueError(f"tp and dp must be >= 1, got tp={tp!r} dp={dp!r}")
    if spec.max_dp is not None and dp > spec.max_dp:
        raise ValueError(f"flavor {flavor} supports dp <= {spec.max_dp}, got {dp}")
    name_filter = name_filter or ENGINE_NAME_FILTER.get(flavor, "ignore")
    if name_filter not in NAME_FILTERS:
        raise ValueError(f"name_filter must be one of {', '.join(NAME_FILTERS)}, got {name_filter!r}")
    if isinstance(scenario, str):
        scenario = load_scenario(scenario)
    if overrides:
        scenario = override_engine(scenario, overrides)
    return SimulatedEngine(spec, scenario, host=host, port=port, speed=speed, seed=seed,
                           model_name=model or spec.default_model, tp=tp, dp=dp, kv_events_endpoint=kv_events_endpoint,
                           served_history=served_history, name_filter=name_filter, router=router)

