"""tests/unit/test_config_properties.py's property, held by the real process: a mutated configuration either starts
(its /healthz answers, SIGTERM ends it with 0) or prints exactly the one line its load raises and exits 2, never a
traceback; the same file at a reload of a running exporter (SIGHUP or POST /-/reload) never stops it: the gauge says
whether it loaded, /-/reload answers 200 or 500 with the line, the log says the same. Only loopback is ever reached:
the configuration's targets and streams are moved there, and an example that would leave it is not run."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml
from hypothesis import HealthCheck, assume, event, given, settings, strategies as st

from devtools import harness
from devtools.harness import GOOD_PAGE, PageServer, page
from kvcache_exporter import config as cfg
from tests.unit.test_config_properties import base, files, write_mutated  # noqa: F401 (files: the fixture)

OUTCOMES = ("configuration reloaded", "reload failed, keeping the running configuration")


def on_loopback(document: dict, server: PageServer) -> dict:
    """base() with every target on the page server (an https one fails its handshake there: a counted failure) and
    every stream on a free loopback port."""
    for index, target in enumerate(document["targets"]):
        url = server.url(f"/t{index}")
        target["url"] = url.replace("http:", "https:") if target["url"].startswith("https:") else url
        events = target.get("kv_events")
        if events:
            events["endpoint"] = f"tcp://127.0.0.1:{harness.free_port()}"
            events["replay_endpoint"] = f"tcp://127.0.0.1:{harness.free_port()}"
    return document


def loaded(path: Path, port: int) -> cfg.Config | cfg.ConfigError:
    """What the exporter's load makes of the file, with the flags the process is given."""
    try:
        return cfg.resolve({"config": str(path), "listen": f"127.0.0.1:{port}"}, {})
    except cfg.ConfigError as err:
        return err


def stays_on_loopback(config: cfg.Config | cfg.ConfigError) -> bool:
    """Whether running it reaches loopback only, with at most two workers and four streams (the machine's share)."""
    if isinstance(config, cfg.ConfigError):
        return True
    hosts = {urlsplit(target.url).hostname for target in config.targets}
    streams = [endpoint for target in config.targets if target.kv_events
               for _, *endpoints in target.kv_events.endpoints() for endpoint in endpoints if endpoint]
    hosts |= {endpoint[len("tcp://"):].rpartition(":")[0] for endpoint in streams}
    return hosts <= {"127.0.0.1"} and config.workers <= 2 and len(streams) <= 8


def argv(path: Path, port: int) -> list[str]:
    return [sys.executable, "-m", "kvcache_exporter", "--config.file", str(path),
            "--web.listen-address", f"127.0.0.1:{port}"]


@pytest.fixture(scope="module")
def server():
    with PageServer({f"/t{index}": page(GOOD_PAGE) for index in range(8)}) as pages:
        yield pages


@pytest.fixture(scope="module")
def running(files, server, tmp_path_factory):  # noqa: F811 (the imported fixture)
    """An exporter whose configuration file the examples rewrite and reload."""
    directory = tmp_path_factory.mktemp("running")
    path, port = directory / "exporter.yml", harness.free_port()
    path.write_text(yaml.safe_dump(on_loopback(base(files), server)))
    with harness.Process("exporter", argv(path, port), directory, f"http://127.0.0.1:{port}/healthz") as exporter:
        exporter.url, exporter.port, exporter.path = f"http://127.0.0.1:{port}", port, path
        yield exporter.wait_ready()
        assert exporter.proc.poll() is None
        assert "Traceback" not in exporter.log_path.read_text()


def start(path: Path, port: int, directory: Path) -> tuple[int, str, str]:
    """Run the exporter on the file until it exits or answers /healthz (then SIGTERM): (exit code, stdout, stderr)."""
    out, err = directory / "stdout", directory / "stderr"
    with open(out, "wb") as stdout, open(err, "wb") as stderr:
        proc = subprocess.Popen(argv(path, port), stdout=stdout, stderr=stderr, stdin=subprocess.DEVNULL,
                                env={"PATH": "/usr/bin:/bin"})
        try:
            harness.wait_until(lambda: proc.poll() is not None
                               or harness.http_get(f"http://127.0.0.1:{port}/healthz", 1)[0] == 200, 30,
                               what="the exporter exited or answered")
            proc.send_signal(signal.SIGTERM)
            code = proc.wait(15)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return code, out.read_text(), err.read_text()


def reload(exporter: harness.Process, by_signal: bool) -> tuple[int, str] | None:
    """Reload by POST /-/reload ((status, body)) or by SIGHUP (None, once the log has the outcome)."""
    if not by_signal:
        return harness.http_post(exporter.url + "/-/reload")
    outcomes = lambda: sum(map(exporter.log_path.read_text().count, OUTCOMES))  # noqa: E731
    before = outcomes()
    exporter.signal(signal.SIGHUP)
    harness.wait_until(lambda: outcomes() == before + 1, 15, what="the SIGHUP reload's outcome logged")
    return None


@settings(max_examples=40, deadline=None, derandomize=True,  # the same examples every run: no CI luck
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_a_mutated_configuration_starts_or_is_one_line_and_exit_2_and_its_reload_never_stops_the_process(
        files, server, running, tmp_path, data):  # noqa: F811
    path, port = tmp_path / "exporter.yml", harness.free_port()
    write_mutated(data, on_loopback(base(files), server), files, path)
    expected = loaded(path, port)
    assume(stays_on_loopback(expected))

    event("refused" if isinstance(expected, cfg.ConfigError) else "starts")
    code, stdout, stderr = start(path, port, tmp_path)
    assert "Traceback" not in stderr, stderr
    if isinstance(expected, cfg.ConfigError):
        assert (code, stdout, stderr) == (2, "", f"kvcache-exporter: {expected}\n")
    else:
        assert code == 0, stderr

    running.path.write_text(path.read_text())
    expected = loaded(running.path, running.port)  # the same error, naming the running file
    by_signal = data.draw(st.booleans(), label="by SIGHUP")
    answer = reload(running, by_signal)
    assert running.proc.poll() is None, running.log_tail()
    ok = not isinstance(expected, cfg.ConfigError)
    if answer is not None:
        assert answer == ((200, "reloaded\n") if ok else (500, f"reload failed: {expected}\n"))
    last = [harness.logfmt(line) for line in running.log_path.read_text().splitlines()
            if any(outcome in line for outcome in OUTCOMES)][-1]
    assert last["message"] == (f"configuration reloaded: {len(expected.targets)} target(s)" if ok
                               else f"{OUTCOMES[1]}: {expected}")
    gauge = harness.value(harness.scrape(running.url), "kvcache_exporter_config_last_reload_successful")
    assert gauge == float(ok)
