"""The exporter's own endpoint against a hostile or careless client, played against a real exporter
process: idle connections by the thousand, slow headers, connect bursts, probe recursion, probe
floods, smuggled requests, user-name timing, secrets in URLs. Throughout, /metrics must answer
within 1 s (the client's timeout: no answer in time fails the test), and the process's threads,
descriptors and memory stay bounded (read from /proc)."""

from __future__ import annotations

import base64
import http.client
import os
import resource
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import bcrypt
import pytest
import yaml

from devtools import harness
from devtools.harness import GOOD_PAGE, LOOPBACK_PROBES, PageServer, page

SECRET = "s3cret-pw-4711"
METRICS_DEADLINE = 1.0  # seconds: /metrics must answer within this, whatever the attack


@pytest.fixture(autouse=True, scope="module")
def enough_descriptors():
    """This test process opens a few thousand sockets: raise its soft limit (bounded by the hard one)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = 8192 if hard == resource.RLIM_INFINITY else min(8192, hard)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, wanted), hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@dataclass
class Usage:
    threads: int
    fds: int
    rss_mib: float


def usage(process) -> Usage:
    pid = process.proc.pid
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    status = dict(line.split(":", 1) for line in lines if ":" in line)
    return Usage(int(status["Threads"]), len(os.listdir(f"/proc/{pid}/fd")),
                 int(status["VmRSS"].split()[0]) / 1024)


def connection_cap(process) -> int:
    """The documented cap: 1,024 connections, or a quarter of the descriptor limit if that is less."""
    for line in Path(f"/proc/{process.proc.pid}/limits").read_text().splitlines():
        if line.startswith("Max open files"):
            soft = line.split()[3]
            return 1024 if soft == "unlimited" else min(1024, max(16, int(soft) // 4))
    raise AssertionError("no descriptor limit in /proc")


def metrics_answer(exporter) -> None:
    with urllib.request.urlopen(exporter.url + "/metrics", timeout=METRICS_DEADLINE) as response:
        assert response.status == 200
        assert b"kvcache_exporter_build_info" in response.read()


def server_closed(sock: socket.socket) -> bool:
    """Whether the exporter has closed this connection (without blocking)."""
    sock.setblocking(False)
    try:
        sock.recv(65536)  # end of stream (or an answer before the close)
        return True
    except BlockingIOError:
        return False
    except OSError:
        return True


def exporter_at(tmp_path, **settings):
    config = tmp_path / "exporter.yml"
    config.write_text(yaml.safe_dump({"poll_interval": "1s", **settings}))
    return harness.exporter(tmp_path, "--config", str(config))


def address(exporter) -> tuple[str, int]:
    return "127.0.0.1", int(exporter.url.rpartition(":")[2])


@pytest.fixture
def engine():
    with PageServer({"/metrics": page(GOOD_PAGE)}) as server:
        yield server


def test_thousands_of_idle_connections_never_lock_out_a_scrape(tmp_path, engine):
    with exporter_at(tmp_path, targets=[{"name": "a", "url": engine.url("/metrics")}]) as exporter:
        metrics_answer(exporter)
        before = usage(exporter)
        cap = connection_cap(exporter)
        idle = [socket.create_connection(address(exporter)) for _ in range(cap + 500)]
        try:
            for _ in range(5):
                metrics_answer(exporter)  # each scrape takes the place of the longest-idle connection
                time.sleep(0.2)
            during = usage(exporter)
            held = sum(not server_closed(sock) for sock in idle)
        finally:
            for sock in idle:
                sock.close()
        assert cap - 10 <= held <= cap  # the cap held, less the places the scrapes took
        assert during.threads <= before.threads + 4  # no thread per connection
        assert during.fds <= before.fds + cap + 8
        assert during.rss_mib <= before.rss_mib + 32


def test_slow_headers_are_cut_off_and_scrapes_go_on(tmp_path):
    with exporter_at(tmp_path) as exporter:
        slow = [socket.create_connection(address(exporter)) for _ in range(300)]
        try:
            for sock in slow:
                sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
            started = time.monotonic()
            for round_ in range(30):  # one header byte each every 0.5 s: 15 s, beyond the 10 s head timeout
                for sock in slow:
                    try:
                        sock.send(b"X")
                    except OSError:
                        pass
                metrics_answer(exporter)
                time.sleep(0.5)
            assert time.monotonic() - started > 12
            assert all(server_closed(sock) for sock in slow)
        finally:
            for sock in slow:
                sock.close()


def test_a_connect_burst_is_accepted_without_stalling(tmp_path):
    with exporter_at(tmp_path) as exporter:
        def one(_):
            started = time.monotonic()
            with socket.create_connection(address(exporter), timeout=5) as sock:
                connected = time.monotonic() - started
                sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                answer = b""
                while chunk := sock.recv(4096):
                    answer += chunk
            return connected, answer

        with ThreadPoolExecutor(16) as pool:
            results = list(pool.map(one, range(2000)))
        # A connection dropped from a full backlog is retried by the kernel after 1 s: none was.
        assert max(connected for connected, _ in results) < 1.0
        assert all(answer.startswith(b"HTTP/1.1 200 OK\r\n") for _, answer in results)


def test_probe_recursion_is_refused(tmp_path):
    everything = {"enabled": True, "allow": ["*"]}
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    with exporter_at(tmp_path / "a", probe=everything) as a, exporter_at(tmp_path / "b", probe=everything) as b:
        before = usage(a)
        # A nested chain of probes, A -> B -> A -> ..., written without re-encoding.
        url = f"{a.url}/metrics"
        while len(url) < 12_000:
            url = f"{b.url if url.startswith(a.url) else a.url}/probe?target={url}"
        assert harness.http_get(f"{a.url}/probe?target={url}/probe?target={url}")[0] == 431  # 24 KB: head too large
        status, body = harness.http_get(f"{a.url}/probe?target={url}")
        assert url.startswith(b.url)  # A polls B's /probe: B refuses a probe from an exporter
        assert status == 200
        samples = {line.split(" ")[0]: line.split(" ")[1] for line in body.splitlines() if line and line[0] != "#"}
        up = [value for name, value in samples.items() if name.startswith("kvcache_target_up")]
        assert up == ["0.0"]
        assert any('reason="http_status"' in name and value == "1.0" for name, value in samples.items())
        # Its own address, under any name, is refused without a poll.
        port = address(a)[1]
        for own in (f"http://127.0.0.1:{port}/probe?target=x", f"http://localhost:{port}/metrics"):
            assert harness.http_get(f"{a.url}/probe?target={urllib.parse.quote(own)}")[0] == 403
        metrics_answer(a)
        after = usage(a)
        assert after.fds <= before.fds + 4 and after.threads <= before.threads + 4


def test_twenty_thousand_distinct_probes_stay_within_the_cap(tmp_path):
    cap = 500
    probes = 20_000
    with exporter_at(tmp_path, staleness="1h", probe={**LOOPBACK_PROBES, "max_targets": cap}) as exporter:
        host, port = address(exporter)
        done = threading.Event()
        scrapes = []

        def scrape_throughout():
            while not done.wait(0.5):
                metrics_answer(exporter)
                scrapes.append(time.monotonic())

        def probe_range(first: int, count: int) -> int:
            connection = http.client.HTTPConnection(host, port, timeout=10)
            answered = 0
            for i in range(first, first + count):  # nothing listens on port 1: each poll fails at once
                connection.request("GET", "/probe?target=" + urllib.parse.quote(f"http://127.0.0.1:1/m?i={i}"))
                response = connection.getresponse()
                response.read()
                answered += response.status == 200
            connection.close()
            return answered

        scraper = threading.Thread(target=scrape_throughout)
        scraper.start()
        try:
            with ThreadPoolExecutor(8) as pool:
                assert sum(pool.map(probe_range, range(0, 2 * cap, cap // 4), [cap // 4] * 8)) == 2 * cap
                at_cap = usage(exporter)
                rest = probes - 2 * cap
                assert sum(pool.map(probe_range, range(2 * cap, probes, rest // 8), [rest // 8] * 8)) == rest
        finally:
            done.set()
            scraper.join()
        after = usage(exporter)
        samples = harness.scrape(exporter.url)
        assert harness.value(samples, "kvcache_exporter_probed_targets") == cap
        assert harness.value(samples, "kvcache_exporter_probe_evictions_total") == probes - cap
        assert len(scrapes) >= 5  # /metrics answered within 1 s all along (else the scraper thread raised)
        assert after.rss_mib <= at_cap.rss_mib + 8
        assert after.fds <= at_cap.fds + 16 and after.threads <= at_cap.threads + 2


def test_a_body_cannot_smuggle_a_request(tmp_path):
    with exporter_at(tmp_path) as exporter:
        with socket.create_connection(address(exporter), timeout=5) as sock:
            smuggled = b"GET /nonexistent HTTP/1.1\r\nHost: x\r\n\r\n"
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(smuggled) + smuggled
                         + b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            answers = read_all(sock)
        assert answers.count(b"HTTP/1.1 ") == 2 and answers.count(b"HTTP/1.1 200 OK") == 2
        assert b"404" not in answers
        with socket.create_connection(address(exporter), timeout=5) as sock:  # chunked + length: refused, closed
            sock.sendall(b"POST /-/reload HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n"
                         b"0\r\n\r\nGET /nonexistent HTTP/1.1\r\nHost: x\r\n\r\n")
            answers = read_all(sock)
        assert answers.startswith(b"HTTP/1.1 501 ") and answers.count(b"HTTP/1.1 ") == 1


def read_all(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def test_kept_alive_replies_come_as_fast_as_fresh_ones(tmp_path, engine):
    with exporter_at(tmp_path, targets=[{"name": "a", "url": engine.url("/metrics")}]) as exporter:
        host, port = address(exporter)

        def timed(connection: http.client.HTTPConnection) -> float:
            started = time.perf_counter()
            connection.request("GET", "/metrics")
            connection.getresponse().read()
            return time.perf_counter() - started

        kept = http.client.HTTPConnection(host, port, timeout=5)
        kept_alive = [timed(kept) for _ in range(40)][1:]
        kept.close()
        fresh = []
        for _ in range(40):
            connection = http.client.HTTPConnection(host, port, timeout=5)
            fresh.append(timed(connection))
            connection.close()
        # A small-write / delayed-ACK stall would add ~40 ms to every kept-alive reply, many times a fresh one's.
        assert statistics.median(kept_alive) < 2 * statistics.median(fresh) + 0.005


def test_basic_auth_takes_as_long_for_an_unknown_user(tmp_path):
    process, port = harness.exporter_with_web_config(tmp_path, {"basic_auth_users": {
        "prometheus": bcrypt.hashpw(b"right", bcrypt.gensalt(rounds=8)).decode()}})
    with process:
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)

        def timed(user: str) -> float:
            token = base64.b64encode(f"{user}:wrong".encode()).decode()
            started = time.perf_counter()
            connection.request("GET", "/metrics", headers={"Authorization": f"Basic {token}"})
            response = connection.getresponse()
            response.read()
            assert response.status == 401
            return time.perf_counter() - started

        known, unknown = [], []
        for _ in range(30):  # interleaved, so that a change of machine load weighs on both alike
            known.append(timed("prometheus"))
            unknown.append(timed("nobody"))
        connection.close()
        ratio = statistics.median(unknown) / statistics.median(known)
        assert 0.7 < ratio < 1.4, ratio  # without the dummy hash an unknown user answered ~70 times faster


def test_credentials_in_a_url_are_refused_and_never_shown(tmp_path, engine):
    leaky = engine.url("/metrics").replace("http://", f"http://scraper:{SECRET}@")
    config = tmp_path / "exporter.yml"
    config.write_text(yaml.safe_dump({"targets": [{"url": leaky}]}))
    for argv in (["--config", str(config)], ["--target", leaky]):
        result = subprocess.run([sys.executable, "-m", "kvcache_exporter", *argv], capture_output=True, text=True, timeout=30)
        assert result.returncode == 2
        assert result.stderr.count("\n") == 1 and "basic_auth.password_file" in result.stderr
        assert SECRET not in result.stdout + result.stderr

    config.write_text(yaml.safe_dump({"targets": [{"name": "a", "url": engine.url("/metrics")}]}))
    with harness.exporter(tmp_path, "--config", str(config)) as exporter:
        config.write_text(yaml.safe_dump({"targets": [{"name": "a", "url": leaky}]}))
        request = urllib.request.Request(exporter.url + "/-/reload", method="POST", data=b"")
        with pytest.raises(urllib.error.HTTPError) as failed:
            urllib.request.urlopen(request, timeout=5)
        answer = failed.value.read().decode()
        assert failed.value.code == 500 and "basic_auth.password_file" in answer and SECRET not in answer
        assert SECRET not in harness.http_get(exporter.url + "/metrics")[1]
    assert SECRET not in exporter.log_path.read_text()
