"""The whole monitoring path (issue 21), each way of running it measured over the same fleet:

- `direct` (path A): Prometheus scrapes every engine page itself;
- `exporter` (path B): the exporter polls every engine, Prometheus scrapes the exporter's one page
  and evaluates the project's recording and alerting rules;
- `probe`: Prometheus scrapes `/probe?target=` per engine through the exporter (the multi-target
  pattern large fleets run), rules loaded as in B;
- `replay` (asked for by name): B with the reading of each page replayed (bench/replay_exporter.py):
  what B costs besides parsing, adapting, deriving and rendering, the floor a faster reader could reach.

    python -m bench.paths [--sizes 100,500,2000] [--workloads vllm,sglang,mix] [--paths direct,exporter,probe,replay]
                          [--targets-per-replica K] [--targets-per-worker K] [--fleet steady|pressure]

`--targets-per-replica K` (250 by default) runs B as replicas of one configuration, one per K engines
rounded up, each polling its share (`--shard INDEX/COUNT`) and scraped by Prometheus as a target of its
own (docs/scaling.md); `--targets-per-worker K` gives each replica a worker process (`workers:`) per K
of its engines. B's CPU and memory are then those of every exporter process.

The fleet is `steady` by default: one pool in 20 under KV pressure (the captured pages), the others
at rest (bench/pages.py), as a fleet runs most days; `pressure` puts every pool under pressure, so
that every one of them raises its KV alerts, and measures what an incident costs Prometheus.

One path runs at a time. For each: warm-up until every engine is up in Prometheus and two more
intervals, then a window of whole intervals in which the CPU of every monitoring process, the
samples Prometheus appended and the bytes its data directory grew by are read; after it,
Prometheus' head series and resident memory, and a snapshot of its TSDB (the head written as a
block) for the bytes a sample takes on disk. docs/performance.md explains the figures.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import time
import urllib.request
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import yaml

from kvcache_exporter.sources import parser
from devtools import harness

from . import paths_report, procstat
from .fleet import Fleet
from .measure import Plan, prometheus_config, record_stacks, scalar, step_shares, summarize_stacks
from .run import begin, choices

PATHS = ("direct", "exporter", "probe", "replay")
POLLING = ("exporter", "replay")  # the paths in which the exporter polls a configured fleet
DEFAULT_PATHS = PATHS[:3]
# Pages as the engines serve them: a Prometheus scraping an engine ingests its whole page (vLLM's
# 435 series with `_created` and the HTTP instrumentator's families), the exporter reads what it needs.
WORKLOADS = {"vllm": ("vllm-v1-58k",), "sglang": ("sglang-tp2",), "mix": ("vllm-v1-58k", "sglang-tp2")}
FLEETS = ("steady", "pressure")
PRESSURE_EVERY = 20  # in a steady fleet, one pool in this many is under pressure
RULES = harness.REPO / "alerts" / "kvcache-rules.yml"
EVALUATION_INTERVAL_S = 30  # the shipped Prometheus configuration's (deploy/compose)
MB = 1e6
# What Prometheus says about its own ingestion, read from its /metrics.
APPENDED = "prometheus_tsdb_head_samples_appended_total"
HEAD_SERIES = "prometheus_tsdb_head_series"


@dataclass
class Stack:
    """The processes of one path: Prometheus always, the exporter's replicas in B and probe mode."""

    prometheus: harness.Process
    data_dir: Path
    exporters: tuple[harness.Process, ...] = ()

    @property
    def pids(self) -> dict[str, list[int]]:
        """Each part's processes: the exporters' workers with them."""
        pids = {"prometheus": [self.prometheus.proc.pid]}
        if self.exporters:
            pids["exporter"] = [pid for exporter in self.exporters
                                for pid in (exporter.proc.pid, *harness.children(exporter.proc.pid))]
        return pids


def fleet_pages(workload: str, fleet: str) -> list[str]:
    """The pages the targets serve, target i the (i mod length)-th."""
    names = WORKLOADS[workload]
    if fleet == "pressure":
        return list(names)
    return [name if turn == 0 else f"{name}-at-rest" for turn in range(PRESSURE_EVERY) for name in names]


def _exporter_config(fleet: Fleet, plan: Plan, path: str, workers: int = 1) -> dict:
    if path == "probe":
        # Every engine keeps its state between probes (rates and the pressure state need history).
        return {"log_level": "warning", "targets": [],
                "probe": {"enabled": True, "allow": ["127.0.0.1"], "max_targets": plan.targets}}
    return {"poll_interval": plan.duration, "log_level": "warning", "workers": workers if path == "exporter" else 1,
            "targets": [{"name": f"t-{i}", "url": fleet.url(i)} for i in range(plan.targets)]}


def _prometheus_config(fleet: Fleet, plan: Plan, path: str, exporter_addresses: list[str]) -> dict:
    if path == "direct":
        return prometheus_config(fleet, plan)
    config = {
        "global": {"scrape_interval": plan.duration, "scrape_timeout": plan.timeout,
                   "evaluation_interval": f"{EVALUATION_INTERVAL_S}s"},
        "rule_files": [str(RULES)],
    }
    if path in POLLING:
        config["scrape_configs"] = [{"job_name": "kvcache-exporter", "static_configs": [{"targets": exporter_addresses}]}]
    else:
        config["scrape_configs"] = [{
            "job_name": "kvcache-probe",
            "metrics_path": "/probe",
            "static_configs": [{"targets": [fleet.url(i) for i in range(plan.targets)]}],
            "relabel_configs": [
                {"source_labels": ["__address__"], "target_label": "__param_target"},
                {"source_labels": ["__param_target"], "target_label": "instance"},
                {"target_label": "__address__", "replacement": exporter_addresses[0]},
            ],
        }]
    return config


def _up_query(path: str) -> str:
    """How many engines Prometheus holds fresh data of."""
    return "count(up == 1)" if path == "direct" else "count(kvcache_target_up == 1)"


def _age_query(path: str) -> str:
    """Age of the oldest engine data a query sees now: since the scrape of the page (A), since the
    exporter's last successful poll (B and probe)."""
    if path == "direct":
        return "max(time() - timestamp(up))"
    return "max(time() - kvcache_target_last_success_timestamp_seconds)"


def _ages_at_scrape(prometheus_url: str, path: str, seconds: float) -> list[float]:
    """The age of the engine data each scrape of the last `seconds` read: 0 for A (the scrape reads the
    page); for B and probe the scrape's timestamp minus the exporter's last successful poll it read.
    Phase-locked polling (exporter/runtime/phase.py) shrinks it in B; probe mode polls at the scrape."""
    if path == "direct":
        return [0.0]
    data = harness.prom_query(prometheus_url, f"kvcache_target_last_success_timestamp_seconds[{int(seconds)}s]")
    return [float(at) - float(value) for series in data["result"] for at, value in series["values"]]


def _own_metrics(prometheus_url: str) -> dict[str, float]:
    with urllib.request.urlopen(prometheus_url + "/metrics", timeout=30) as response:
        text = response.read().decode()
    names = (APPENDED, HEAD_SERIES)
    samples = parser.parse(text, frozenset(names))
    return {name: sum(sample.value for sample in samples.get(name, ())) for name in names}


def _directory_bytes(path: Path) -> int:
    """Bytes allocated on disk under `path` (as `du` counts them: a WAL segment grows as it is written)."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.stat(os.path.join(root, name)).st_blocks * 512
            except FileNotFoundError:
                continue
    return total


def _rule_seconds(prometheus_url: str) -> dict:
    """Wall time of the last evaluation of the recording and of the alerting rules, and the alerts
    active (pending or firing): every active alert's labels and annotations are expanded at every
    evaluation."""
    with urllib.request.urlopen(prometheus_url + "/api/v1/rules", timeout=30) as response:
        groups = json.loads(response.read())["data"]["groups"]
    rules = [rule for group in groups for rule in group["rules"]]
    return {"recording_s": sum(r["evaluationTime"] for r in rules if r["type"] == "recording"),
            "alerting_s": sum(r["evaluationTime"] for r in rules if r["type"] == "alerting"),
            "alerts_active": sum(len(r.get("alerts", ())) for r in rules if r["type"] == "alerting")}


def _snapshot_block(prometheus_url: str, data_dir: Path) -> dict:
    """The head written as one block (the admin API's snapshot): its chunk and index bytes, samples and
    series, and the time it spans."""
    request = urllib.request.Request(prometheus_url + "/api/v1/admin/tsdb/snapshot", method="POST")
    with urllib.request.urlopen(request, timeout=300) as response:
        name = json.loads(response.read())["data"]["name"]
    blocks = [block for block in (data_dir / "snapshots" / name).iterdir() if (block / "meta.json").exists()]
    chunks = index = samples = series = 0
    span_ms = 0
    for block in blocks:
        meta = json.loads((block / "meta.json").read_text())
        chunks += _directory_bytes(block / "chunks")
        index += (block / "index").stat().st_size
        samples += meta["stats"]["numSamples"]
        series += meta["stats"]["numSeries"]
        span_ms = max(span_ms, meta["maxTime"] - meta["minTime"])
    return {"chunk_bytes": chunks, "index_bytes": index, "samples": samples, "series": series,
            "span_s": span_ms / 1e3}


def _start(stack: ExitStack, fleet: Fleet, plan: Plan, path: str, work_dir: Path, workers: int,
           replicas: int) -> Stack:
    exporters = []
    if path != "direct":
        config_path = work_dir / "exporter.yml"
        config_path.write_text(yaml.safe_dump(_exporter_config(fleet, plan, path, workers), sort_keys=False))
        module = "bench.replay_exporter" if path == "replay" else "kvcache_exporter"
        for index in range(replicas):  # one configuration, each replica its share
            log_dir = work_dir / f"replica-{index}"
            log_dir.mkdir()
            exporters.append(stack.enter_context(harness.exporter(
                log_dir, "--config", str(config_path), "--shard", f"{index}/{replicas}", module=module)))
    config = _prometheus_config(fleet, plan, path, [exporter.url.removeprefix("http://") for exporter in exporters])
    prometheus = stack.enter_context(harness.prometheus(work_dir, config, extra_args=("--web.enable-admin-api",)))
    return Stack(prometheus, work_dir / "data", tuple(exporters))


def processes_for(targets: int, per_process: int) -> int:
    """Replicas (or workers) of `per_process` engines each, rounded up; `per_process` 0 means one process for any number."""
    return max(1, math.ceil(targets / per_process)) if per_process else 1


def measure_path(fleet: Fleet, plan: Plan, path: str, work_dir: Path, workers: int = 1, replicas: int = 1) -> dict:
    shutil.rmtree(work_dir, ignore_errors=True)
    work_dir.mkdir(parents=True)
    try:
        with ExitStack() as stack:
            replicas = replicas if path in POLLING else 1
            workers = workers if path == "exporter" else 1
            processes = _start(stack, fleet, plan, path, work_dir, workers, replicas)
            url = processes.prometheus.url
            harness.wait_until(lambda: scalar(url, _up_query(path)) == plan.targets,
                               timeout=90 + 10 * plan.interval, interval=1.0, what=f"every engine up ({path})")
            if path in POLLING:  # eight regular scrapes lock the polls to Prometheus' phase
                harness.wait_until(lambda: scalar(url, "min(kvcache_exporter_poll_phase_locked)") == 1.0,
                                   timeout=20 * plan.interval, interval=1.0, what=f"the polls phase-locked ({path})")
            time.sleep(plan.warmup_cycles * plan.interval)
            figures = {**_window(processes, fleet, plan, path), "workers": workers, "replicas": replicas}
            if plan.profile_dir is not None and path == "exporter":
                figures["profile"] = _profile(processes, plan, work_dir.name)
            return figures
    finally:
        shutil.rmtree(work_dir / "data", ignore_errors=True)  # up to a million series


def _window(processes: Stack, fleet: Fleet, plan: Plan, path: str) -> dict:
    url = processes.prometheus.url
    pids = processes.pids
    cpu_before = {name: sum(map(procstat.cpu_seconds, group)) for name, group in pids.items()}
    server_before, machine_before = procstat.cpu_seconds(fleet.pid), procstat.machine_busy_seconds()
    own_before, disk_before = _own_metrics(url), _directory_bytes(processes.data_dir)
    started = time.monotonic()
    ages = []
    # The oldest data age, read at phases spread over the window (a query costs Prometheus well
    # under a millisecond of CPU per thousand series).
    while time.monotonic() - started < plan.cycles * plan.interval - 0.6 * plan.interval:
        time.sleep(0.55 * plan.interval)
        ages.append(scalar(url, _age_query(path)))
    time.sleep(max(0.0, plan.cycles * plan.interval - (time.monotonic() - started)))
    wall = time.monotonic() - started
    at_scrape = sorted(_ages_at_scrape(url, path, wall))
    cpu = {name: sum(map(procstat.cpu_seconds, group)) - cpu_before[name] for name, group in pids.items()}
    server_cpu = procstat.cpu_seconds(fleet.pid) - server_before
    machine = procstat.machine_busy_seconds() - machine_before
    own_after, disk_after = _own_metrics(url), _directory_bytes(processes.data_dir)
    samples_per_s = (own_after[APPENDED] - own_before[APPENDED]) / wall
    result = {
        "window_s": round(wall, 3),
        "cores": {name: seconds / wall for name, seconds in cpu.items()},
        "monitoring_cores": sum(cpu.values()) / wall,
        "engine_serving_cores": server_cpu / wall,
        "other_load_cores": (machine - sum(cpu.values()) - server_cpu) / wall,
        "samples_per_s": samples_per_s,
        "head_series": own_after[HEAD_SERIES],
        "rules": _rule_seconds(url),
        "prometheus_rss_mb": procstat.memory_bytes(pids["prometheus"][0])[0] / MB,
        "wal_mb_per_hour": (disk_after - disk_before) / wall * 3600 / MB,
        "oldest_age_s": max(ages),
        "oldest_age_median_s": sorted(ages)[len(ages) // 2],
        "age_at_scrape_max_s": at_scrape[-1],
        "age_at_scrape_median_s": at_scrape[len(at_scrape) // 2],
        "phase_locked": scalar(url, "min(kvcache_exporter_poll_phase_locked)") == 1.0 if path in POLLING else None,
        "engines_up": scalar(url, _up_query(path)),
    }
    if processes.exporters:
        result["exporter_rss_mb"] = sum(procstat.memory_bytes(pid)[0] for pid in pids["exporter"]) / MB
    block = _snapshot_block(url, processes.data_dir)
    result["block"] = block
    result["tsdb_mb_per_hour"] = tsdb_bytes_per_hour(block, samples_per_s) / MB
    return result


def _profile(processes: Stack, plan: Plan, name: str) -> dict:
    """Where B's exporter CPU goes, by step of a poll or a scrape: py-spy over one more window of every
    replica at once (after the measured one: the sampling costs CPU of its own), its stacks kept."""
    collapsed = record_stacks(processes.pids["exporter"], plan.cycles * plan.interval)
    plan.profile_dir.mkdir(parents=True, exist_ok=True)
    (plan.profile_dir / f"{name}.collapsed").write_text(collapsed)
    (plan.profile_dir / f"{name}.txt").write_text(summarize_stacks(collapsed))
    return step_shares(collapsed)


def tsdb_bytes_per_hour(block: dict, samples_per_s: float) -> float:
    """Bytes one hour adds to the TSDB's blocks: the samples at the snapshot's bytes per sample, and half
    an index (Prometheus cuts a block, with its own index, every two hours)."""
    bytes_per_sample = block["chunk_bytes"] / block["samples"] if block["samples"] else 0.0
    return samples_per_s * 3600 * bytes_per_sample + block["index_bytes"] / 2


def _locked(figures: dict) -> str:
    return {True: " (phase-locked)", False: " (own cadence)", None: ""}[figures.get("phase_locked")]


def arguments(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.paths", description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="100,500,2000", help="numbers of engines, comma-separated")
    p.add_argument("--interval", type=float, default=5.0, help="poll and scrape interval, seconds")
    p.add_argument("--cycles", type=int, default=12, help="intervals in each measured window (12 x 5 s holds 2 rule evaluations)")
    # Locked, a target whose lead grows waits for its next lattice point (never two polls in an interval):
    # at 2,000 SGLang engines with two workers some were a whole interval old 3 intervals after the lock.
    p.add_argument("--warmup", type=int, default=4,
                   help="intervals to wait once every engine is up (and, polling, once the polls are phase-locked)")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma-separated, of {', '.join(WORKLOADS)}")
    p.add_argument("--paths", default=",".join(DEFAULT_PATHS), help=f"comma-separated, of {', '.join(PATHS)}")
    p.add_argument("--targets-per-replica", type=int, default=250,
                   help="path B as exporter replicas, one per this many engines, each polling its share (0: one)")
    p.add_argument("--targets-per-worker", type=int, default=0,
                   help="each replica of path B with a worker process per this many of its engines (0: none)")
    p.add_argument("--fleet", choices=FLEETS, default="steady",
                   help=f"steady: one pool in {PRESSURE_EVERY} under KV pressure; pressure: every pool")
    p.add_argument("--profile", action="store_true",
                   help="after each window of path B, sample one more with py-spy: B's exporter CPU by step")
    p.add_argument("--out", type=Path, default=Path("bench/results-paths"))
    args = p.parse_args(argv)
    args.sizes = [int(size) for size in args.sizes.split(",")]
    args.workloads = choices(p, args.workloads, WORKLOADS, "workload")
    args.paths = choices(p, args.paths, PATHS, "path")
    return args


def main(argv: list[str]) -> int:
    args = arguments(argv)
    out, page_paths, results = begin(args, paths=args.paths, evaluation_interval_s=EVALUATION_INTERVAL_S,
                                     fleet=args.fleet, targets_per_replica=args.targets_per_replica,
                                     targets_per_worker=args.targets_per_worker,
                                     pressure_every=1 if args.fleet == "pressure" else PRESSURE_EVERY)
    for workload in args.workloads:
        served = [page_paths[name] for name in fleet_pages(workload, args.fleet)]
        with Fleet(workload, served, out / "logs") as fleet:
            for size in args.sizes:
                plan = Plan(size, args.interval, args.cycles, args.warmup,
                            profile_dir=out / "profiles" if args.profile else None)
                run = {"workload": workload, "targets": size}
                for path in args.paths:
                    started = time.monotonic()
                    replicas = processes_for(size, args.targets_per_replica)
                    run[path] = measure_path(fleet, plan, path, out / "work" / f"{workload}-{size}-{path}",
                                             processes_for(math.ceil(size / replicas), args.targets_per_worker),
                                             replicas)
                    figures = run[path]
                    print(f"{workload} N={size} {path}: {figures['monitoring_cores']:.3f} cores, "
                          f"{figures['samples_per_s']:,.0f} samples/s, {figures['head_series']:,.0f} series, "
                          f"Prometheus {figures['prometheus_rss_mb']:.0f} MB, oldest {figures['oldest_age_s']:.1f} s, "
                          f"at scrape {figures['age_at_scrape_median_s']:.2f} s median, "
                          f"{figures['age_at_scrape_max_s']:.2f} s max{_locked(figures)}, "
                          f"other load {figures['other_load_cores']:.2f} ({time.monotonic() - started:.0f} s)",
                          flush=True)
                results["runs"].append(run)
                (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    print(paths_report.write(results, out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
