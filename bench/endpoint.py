"""The exporter's own endpoint under load and attack: figures for docs/robustness.md.

    python -m bench.endpoint [--targets 1000] [--idle 1500] [--probes 20000]

1. A fleet of N targets polled every 5 s, /metrics scraped gzipped back to back by two clients:
   how long /metrics and /healthz take meanwhile. /healthz is answered by the event loop that
   also runs the polls, so its latency shows how long rendering /metrics holds that loop up.
2. `--idle` connections opened and left idle: how many the exporter holds, its threads,
   descriptors and memory, and /metrics' latency meanwhile.
3. `--probes` distinct probe URLs (port 1: each poll fails at once) at the default
   probe.max_targets: memory at the cap and after, evictions, probes per second.
"""

from __future__ import annotations

import argparse
import gzip
import http.client
import os
import resource
import socket
import statistics
import tempfile
import threading
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import yaml

from bench.fleet import Fleet
from bench.procstat import memory_bytes
from devtools import harness


def timed_get(host: str, port: int, path: str, gzipped: bool = False) -> float:
    connection = http.client.HTTPConnection(host, port, timeout=10)
    started = time.perf_counter()
    connection.request("GET", path, headers={"Accept-Encoding": "gzip"} if gzipped else {})
    body = connection.getresponse().read()
    elapsed = time.perf_counter() - started
    connection.close()
    if gzipped:
        gzip.decompress(body)
    return elapsed


def figures(samples: list[float]) -> str:
    samples = sorted(samples)
    return (f"median {statistics.median(samples) * 1000:.1f} ms, p99 {samples[int(len(samples) * 0.99)] * 1000:.1f} ms,"
            f" max {samples[-1] * 1000:.1f} ms ({len(samples)})")


def process_usage(pid: int) -> str:
    threads = sum(1 for _ in os.scandir(f"/proc/{pid}/task"))
    fds = len(os.listdir(f"/proc/{pid}/fd"))
    return f"{threads} threads, {fds} descriptors, RSS {memory_bytes(pid)[0] / 2**20:.0f} MiB"


def exporter(work: Path, settings: dict):
    config = work / "exporter.yml"
    config.write_text(yaml.safe_dump(settings))
    return harness.exporter(work, "--config", str(config))


def scrape_under_load(work: Path, targets: int, seconds: float) -> None:
    with Fleet("endpoint", [Path("vllm-v1.txt")], work) as fleet, exporter(work, {
            "poll_interval": "5s", "targets": [{"name": f"t{i}", "url": fleet.url(i)} for i in range(targets)]}) as ex:
        host, port = "127.0.0.1", int(ex.url.rpartition(":")[2])
        harness.wait_until(lambda: harness.http_get(ex.url + "/ready")[0] == 200, 60, what="ready")
        time.sleep(5)  # a whole interval: every target's text rendered
        stop = threading.Event()
        metrics: list[float] = []

        def scrape() -> None:
            while not stop.is_set():
                metrics.append(timed_get(host, port, "/metrics", gzipped=True))

        scrapers = [threading.Thread(target=scrape) for _ in range(2)]
        for thread in scrapers:
            thread.start()
        healthz = []
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            healthz.append(timed_get(host, port, "/healthz"))
            time.sleep(0.02)
        stop.set()
        for thread in scrapers:
            thread.join()
        print(f"{targets} targets, /metrics gzipped by 2 clients back to back for {seconds:g} s:")
        print(f"  /metrics: {figures(metrics)}")
        print(f"  /healthz meanwhile: {figures(healthz)}")
        print(f"  exporter: {process_usage(ex.proc.pid)}")


def idle_connections(work: Path, count: int) -> None:
    with exporter(work, {}) as ex:
        host, port = "127.0.0.1", int(ex.url.rpartition(":")[2])
        print(f"idle connections: before, {process_usage(ex.proc.pid)}")
        socks = [socket.create_connection((host, port)) for _ in range(count)]
        latencies = [timed_get(host, port, "/metrics") for _ in range(20)]
        held = 0
        for sock in socks:
            sock.setblocking(False)
            try:
                sock.recv(1)
            except BlockingIOError:
                held += 1
            except OSError:
                pass
        print(f"  {count} opened, {held} held by the exporter; {process_usage(ex.proc.pid)}")
        print(f"  /metrics meanwhile: {figures(latencies)}")
        for sock in socks:
            sock.close()


def probe_flood(work: Path, probes: int) -> None:
    with exporter(work, {"staleness": "1h", "probe": {"enabled": True, "allow": ["127.0.0.0/8"]}}) as ex:
        host, port = "127.0.0.1", int(ex.url.rpartition(":")[2])
        print(f"probe flood: before, {process_usage(ex.proc.pid)}")

        def probe_range(first: int, count: int) -> None:
            connection = http.client.HTTPConnection(host, port, timeout=10)
            for i in range(first, first + count):
                connection.request("GET", "/probe?target=" + urllib.parse.quote(f"http://127.0.0.1:1/m?i={i}"))
                connection.getresponse().read()
            connection.close()

        started = time.perf_counter()
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(probe_range, range(0, probes, probes // 8), [probes // 8] * 8))
        elapsed = time.perf_counter() - started
        samples = harness.scrape(ex.url)
        kept = harness.value(samples, "kvcache_exporter_probed_targets")
        evicted = harness.value(samples, "kvcache_exporter_probe_evictions_total")
        print(f"  {probes} distinct URLs in {elapsed:.1f} s ({probes / elapsed:.0f}/s): {kept:.0f} kept, "
              f"{evicted:.0f} evicted; {process_usage(ex.proc.pid)}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--targets", type=int, default=1000)
    parser.add_argument("--seconds", type=float, default=20)
    parser.add_argument("--idle", type=int, default=1500)
    parser.add_argument("--probes", type=int, default=20_000)
    args = parser.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, args.idle + 512)), hard))
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for name in ("scrape", "idle", "probes"):
            (work / name).mkdir()
        scrape_under_load(work / "scrape", args.targets, args.seconds)
        idle_connections(work / "idle", args.idle)
        probe_flood(work / "probes", args.probes)


if __name__ == "__main__":
    main()
