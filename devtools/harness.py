"""Real processes on loopback for the end-to-end tests: Prometheus, Alertmanager, the exporter.

Every server binds 127.0.0.1 on a port picked here, logs to a file under the test's tmp dir,
and is stopped when its context exits; a start-up failure raises with the tail of its log.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Callable, Iterator

REPO = Path(__file__).resolve().parents[1]


def require_binary(name: str) -> str:
    """Path of a tool the suite needs; its absence is an error, never a skip."""
    path = shutil.which(name)
    if path is None:
        raise RuntimeError(f"{name} is not installed: run `make test`, which installs it")
    return path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def http_get(url: str, timeout: float = 5.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode(errors="replace")


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


def scrape(base_url: str) -> dict[tuple[str, tuple], float]:
    """The exporter's /metrics as {(sample name, sorted label pairs): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    status, body = http_get(base_url + "/metrics")
    if status != 200:
        raise ValueError(f"/metrics answered {status}")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(body) for s in family.samples}


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
