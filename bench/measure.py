"""One measurement: the exporter, or Prometheus, polling N targets of the fleet at a fixed interval.

Each process runs alone against the page server (the two never run at the same time), warms up
for a few cycles, and is then measured over a steady-state window of whole cycles: its CPU from
/proc/<pid>/stat, the requests the server received from it (bench/fleet.py), its resident memory at the
end. The exporter is then scraped a few times, at different phases of its poll cycle, for
freshness and /metrics render time; nothing scrapes it inside the CPU window.
"""

from __future__ import annotations

import gzip
import http.client
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from statistics import median

import yaml

from kvcache_exporter.sources import parser
from devtools import harness

from . import procstat
from .fleet import Fleet

LAST_SUCCESS = "kvcache_target_last_success_timestamp_seconds"
UP = "kvcache_target_up"
MB = 1e6


@dataclass(frozen=True)
class Plan:
    targets: int
    interval: float  # seconds between polls of a target
    cycles: int  # cycles in the measured window
    warmup_cycles: int = 2
    scrapes: int = 4  # scrapes of the exporter's /metrics after the window
    profile_dir: Path | None = None  # where py-spy's profile of one more window goes, if wanted

    @property
    def duration(self) -> str:
        """The interval as both the exporter and Prometheus spell a duration."""
        return f"{round(self.interval * 1000)}ms"

    @property
    def timeout(self) -> str:
        return f"{round(self.interval * 800)}ms"  # the exporter's default: 0.8 x interval


def steady_window(pid: int, fleet: Fleet, plan: Plan) -> dict:
    """CPU, requests served and memory of `pid` over `plan.cycles` poll cycles."""
    traffic_before, before, server_before = fleet.traffic(), procstat.Reading.now(pid), procstat.cpu_seconds(fleet.pid)
    started = time.monotonic()
    time.sleep(plan.cycles * plan.interval)
    wall = time.monotonic() - started
    traffic_after, after, server_after = fleet.traffic(), procstat.Reading.now(pid), procstat.cpu_seconds(fleet.pid)
    rss, peak = procstat.memory_bytes(pid)
    cpu, server_cpu = after.cpu - before.cpu, server_after - server_before
    requests = traffic_after.requests - traffic_before.requests
    cycles = wall / plan.interval
    return {
        "window_s": round(wall, 3),
        "cpu_s": round(cpu, 3),
        "cpu_per_cycle_s": cpu / cycles,
        "cores": cpu / wall,
        "requests": requests,
        # Below 1: polls were skipped (or connections dropped, see `connections`).
        "completed_share": requests / (plan.targets * cycles),
        "cpu_per_request_us": cpu / requests * 1e6 if requests else None,
        "system_share": (after.system - before.system) / cpu if cpu else None,  # kernel: sockets, futexes
        "context_switches_per_request": (after.switches - before.switches) / requests if requests else None,
        "rss_mb": rss / MB,
        "peak_rss_mb": peak / MB,
        "connections": [traffic_before.connections, traffic_after.connections],
        "server_cpu_per_request_us": server_cpu / requests * 1e6 if requests else None,
        # Everything else the machine ran meanwhile (other work on a shared machine), in cores.
        "other_load_cores": (after.machine - before.machine - cpu - server_cpu) / wall,
    }


def measure_exporter(fleet: Fleet, plan: Plan, work_dir: Path) -> dict:
    work_dir.mkdir(parents=True, exist_ok=True)
    config_path = work_dir / "exporter.yml"
    config_path.write_text(yaml.safe_dump({
        "poll_interval": plan.duration,
        "log_level": "warning",
        "targets": [{"name": f"t-{i}", "url": fleet.url(i)} for i in range(plan.targets)],
    }, sort_keys=False))
    with harness.exporter(work_dir, "--config", str(config_path)) as proc:
        harness.wait_until(lambda: harness.http_get(proc.url + "/ready")[0] == 200,
                           timeout=60 + 10 * plan.interval, what="the exporter's first poll cycle")
        time.sleep(plan.warmup_cycles * plan.interval)
        result = steady_window(proc.proc.pid, fleet, plan)
        result.update(_scrapes(proc.url, plan))
        # The high-water mark after the scrapes: a scrape holds the compressed body and a block of the text.
        result["peak_rss_mb"] = procstat.memory_bytes(proc.proc.pid)[1] / MB
        if plan.profile_dir is not None:
            result["profile"] = profile(proc.proc.pid, plan, f"exporter-{plan.targets}")
    return result


def _scrapes(base_url: str, plan: Plan) -> dict:
    """Freshness and /metrics cost from `plan.scrapes` pairs of scrapes (gzip, as Prometheus asks,
    then uncompressed) spread over the poll cycle's phases."""
    ages, up, sizes, seconds = [], [], [], {"gzip": [], "plain": []}
    for index in range(plan.scrapes):
        if index:
            time.sleep(0.6 * plan.interval)  # 0.6 of a cycle: successive scrapes land at different phases
        started_unix, seconds_gzip, compressed = timed_get(base_url + "/metrics", compressed=True)
        body = gzip.decompress(compressed) if compressed.startswith(b"\x1f\x8b") else compressed
        samples = parser.parse(body.decode(), frozenset({LAST_SUCCESS, UP}))
        # Prometheus stamps a scrape with its start: the age of the oldest target's data then.
        ages.append(started_unix - min(s.value for s in samples.get(LAST_SUCCESS, ())))
        up.append(sum(s.value for s in samples.get(UP, ())))
        sizes.append((len(body), len(compressed)))
        seconds["gzip"].append(seconds_gzip)
        seconds["plain"].append(timed_get(base_url + "/metrics")[1])
    return {
        "oldest_age_s": max(ages),
        "oldest_age_median_s": median(ages),
        "targets_up": min(up),
        "metrics_mb": median(size for size, _ in sizes) / MB,
        "metrics_gzip_mb": median(size for _, size in sizes) / MB,
        "render_gzip_ms": median(seconds["gzip"]) * 1e3,
        "render_gzip_max_ms": max(seconds["gzip"]) * 1e3,
        "render_ms": median(seconds["plain"]) * 1e3,
        "render_max_ms": max(seconds["plain"]) * 1e3,
    }


def timed_get(url: str, compressed: bool = False) -> tuple[float, float, bytes]:
    """(unix time at the start, seconds until the last byte, body as sent) of one GET on a new connection."""
    parts = urllib.parse.urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
    headers = {"Accept-Encoding": "gzip"} if compressed else {}
    started_unix, started = time.time(), time.perf_counter()
    try:
        connection.request("GET", parts.path, headers=headers)
        response = connection.getresponse()
        body = response.read()
    finally:
        connection.close()
    if response.status != 200:
        raise RuntimeError(f"GET {url}: HTTP {response.status}")
    return started_unix, time.perf_counter() - started, body


def prometheus_config(fleet: Fleet, plan: Plan) -> dict:
    """N static targets on the page server, one metrics path each, at the exporter's interval and timeout."""
    return {
        "global": {"scrape_interval": plan.duration, "scrape_timeout": plan.timeout},
        "scrape_configs": [{
            "job_name": "fleet",
            "static_configs": [{"targets": [f"127.0.0.1:{fleet.port}"],
                                "labels": {"__metrics_path__": f"/t/{i}", "instance": f"t-{i}"}}
                               for i in range(plan.targets)],
        }],
    }


def measure_prometheus(fleet: Fleet, plan: Plan, work_dir: Path) -> dict:
    try:
        with harness.prometheus(work_dir, prometheus_config(fleet, plan)) as proc:
            harness.wait_until(lambda: scalar(proc.url, "count(up == 1)") == plan.targets,
                               timeout=60 + 10 * plan.interval, interval=1.0, what="every target scraped")
            time.sleep(plan.warmup_cycles * plan.interval)
            result = steady_window(proc.proc.pid, fleet, plan)
            result["targets_up"] = scalar(proc.url, "count(up == 1)")
            result["scrape_duration_ms"] = scalar(proc.url, "avg(scrape_duration_seconds)") * 1e3
            result["samples_per_scrape"] = scalar(proc.url, "avg(scrape_samples_scraped)")
    finally:
        shutil.rmtree(work_dir / "data", ignore_errors=True)  # a TSDB of up to a million series
    return result


def scalar(base_url: str, expr: str) -> float:
    """An instant query's single value, 0 when it returns nothing."""
    result = harness.prom_vector(base_url, expr)
    return result[0][1] if result else 0.0


def profile(pid: int, plan: Plan, name: str) -> str:
    """py-spy's samples of one more window (`record_stacks`) as a summary of where the Python CPU goes;
    returns the summary's path."""
    plan.profile_dir.mkdir(parents=True, exist_ok=True)
    collapsed = record_stacks([pid], plan.cycles * plan.interval)
    (plan.profile_dir / f"{name}.collapsed").write_text(collapsed)
    summary = plan.profile_dir / f"{name}.txt"
    summary.write_text(summarize_stacks(collapsed))
    return str(summary)


def record_stacks(pids: list[int], seconds: float) -> str:
    """py-spy samples the thread holding the GIL in each process at once for `seconds`, without pausing it
    (pausing it 100 times a second makes polls time out); the collapsed stacks of all of them. Work done with
    the GIL released (socket I/O in the kernel, zlib) does not show."""
    spy = str(Path(sys.executable).with_name("py-spy"))
    with tempfile.TemporaryDirectory() as scratch:
        outputs = [Path(scratch) / f"{pid}.collapsed" for pid in pids]
        runs = [subprocess.Popen([spy, "record", "--pid", str(pid), "--duration", str(round(seconds)), "--rate", "200",
                                  "--gil", "--nonblocking", "--format", "raw", "--output", str(output)],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
                for pid, output in zip(pids, outputs)]
        for run in runs:
            _, err = run.communicate()
            if run.returncode:
                raise RuntimeError(f"py-spy exited {run.returncode}: {err.decode(errors='replace').strip()}")
        return "".join(output.read_text() for output in outputs)


# The steps of a poll and of a scrape, each named by the functions that do it or by its module: a sample
# belongs to the step of the innermost of these on its stack (py-spy reads a running process, so a stack may
# lack its outer frames); the rest is the event loops and the scheduler.
STEP_FRAMES = {
    "Fetcher.fetch (exporter/sources/fetch.py)": "fetch",
    "_parse (exporter/runtime/target.py)": "parse",
    "detect (exporter/adapters/__init__.py)": "adapt",  # which engine's page: once a poll
    "Target._render (exporter/runtime/target.py)": "render",
    "render_target (exporter/exposition.py)": "render",
    "_pool_lines (exporter/exposition.py)": "render",
    # a scrape: the request on the server's loop, the page's text and its gzip in threads of their own
    "MetricsServer._handle (exporter/runtime/server.py)": "serve",
    "Exporter._metrics.<locals>.<lambda> (exporter/runtime/app.py)": "serve",
    "render (exporter/exposition.py)": "serve",
    "_gzip (exporter/runtime/server.py)": "serve",
}
STEP_MODULES = {"exporter/sources/fetch.py": "fetch", "exporter/sources/parser.py": "parse",
                "exporter/adapters/base.py": "adapt", "exporter/derive.py": "derive"}
STEPS = ("fetch", "parse", "adapt", "derive", "render", "serve", "loop")


def step_shares(collapsed: str) -> dict:
    """The samples, and each step's share of them (`STEP_FRAMES`, `STEP_MODULES`; `loop` for the rest)."""
    counts = dict.fromkeys(STEPS, 0)
    for line in collapsed.splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack:
            continue
        step = next(filter(None, map(_step, reversed(stack.split(";")))), "loop")
        counts[step] += int(count_text)
    total = sum(counts.values())
    return {"samples": total, "shares": {step: count / total if total else 0.0 for step, count in counts.items()}}


def summarize_stacks(collapsed: str, top: int = 30) -> str:
    """Share of samples per function: inclusive (anywhere on the stack) and self (the innermost frame)."""
    inclusive: dict[str, int] = {}
    own: dict[str, int] = {}
    total = 0
    for line in collapsed.splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack:
            continue
        count = int(count_text)
        total += count
        frames = [_short(frame) for frame in stack.split(";")]
        for frame in set(frames):
            inclusive[frame] = inclusive.get(frame, 0) + count
        own[frames[-1]] = own.get(frames[-1], 0) + count
    lines = [f"{total} samples", "", f"{'inclusive':>9} {'self':>6}  function"]
    for frame, count in sorted(inclusive.items(), key=lambda item: -item[1])[:top]:
        lines.append(f"{100 * count / total:8.1f}% {100 * own.get(frame, 0) / total:5.1f}%  {frame}")
    lines += ["", "by self time:"]
    for frame, count in sorted(own.items(), key=lambda item: -item[1])[:top]:
        lines.append(f"{100 * count / total:8.1f}%  {frame}")
    return "\n".join(lines) + "\n"


def _step(frame: str) -> str | None:
    short = _short(frame)
    return STEP_FRAMES.get(short) or STEP_MODULES.get(short.partition(" (")[2][:-1])


def _short(frame: str) -> str:
    """`function (path/to/file.py:LINE)` without the line and the path up to the package."""
    name, _, where = frame.partition(" (")
    path = where.rsplit(":", 1)[0]
    for marker in ("/site-packages/", "/lib/python3", f"{harness.REPO}/"):
        if marker in path:
            path = path.split(marker, 1)[1]
    return f"{name} ({path})"
