"""The fleet benchmark of issue 7, in one command (docs/performance.md explains the figures):

    python -m bench.run [--sizes 100,500,1000,2000] [--interval 5] [--cycles 6] [--out bench/results]

For each workload (bench/pages.py) one page server serves the targets; for each N the exporter
polls N of them, then Prometheus scrapes the same N, one after the other, never together. Writes
results.json, results.md and performance.png into the out directory and prints the Markdown.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from kvcache_exporter import adapters
from kvcache_exporter.sources import parser
from devtools import harness

from . import measure, pages, parser_speed, procstat, report
from .fleet import Fleet


def parser_figures(text: str) -> dict:
    """Our parser against prometheus_client's on one page, after checking that both read the same samples."""
    wanted = adapters.detect(text).wanted
    samples = parser_speed.check_equal(text, wanted)
    ours = parser_speed.best_of(lambda: parser.parse(text, wanted), repeat=5, number=200)
    theirs = parser_speed.best_of(lambda: parser_speed.oracle(text), repeat=3, number=10)
    megabytes = len(text.encode()) / 1e6
    return {"samples": samples, "ours_ms": ours * 1e3, "prometheus_client_ms": theirs * 1e3,
            "ours_mb_s": megabytes / ours, "prometheus_client_mb_s": megabytes / theirs, "speedup": theirs / ours}


def code_version() -> str:
    """The commit measured, marked `+changes` when the working tree differs from it."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], capture_output=True, text=True, cwd=harness.REPO).stdout.strip()

    changed = git("status", "--porcelain", "--untracked-files=no", "--", "exporter")
    return git("rev-parse", "--short", "HEAD") + ("+changes" if changed else "")


def prometheus_version() -> str:
    out = subprocess.run([harness.require_binary("prometheus"), "--version"], capture_output=True, text=True)
    return " ".join((out.stdout or out.stderr).split()[:3])  # "prometheus, version X.Y.Z"


def measured_on() -> dict:
    """What a results file says about where and what was measured."""
    return {"machine": procstat.machine(), "prometheus_version": prometheus_version(), "code": code_version()}


def choices(p: argparse.ArgumentParser, value: str, known, what: str) -> list[str]:
    """A comma-separated list of `known` names; another name is the parser's error."""
    given = value.split(",")
    unknown = set(given) - set(known)
    if unknown:
        p.error(f"unknown {what}(s): {', '.join(sorted(unknown))}")
    return given


def begin(args: argparse.Namespace, **settings) -> tuple[Path, dict[str, Path], dict]:
    """The output folder (made), the engine pages written into it, and the results' head: where and what is
    measured, the common settings and `settings`."""
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    results = {**measured_on(),
               "settings": {"sizes": args.sizes, "interval": args.interval, "cycles": args.cycles,
                            "warmup_cycles": args.warmup, "workloads": args.workloads, **settings},
               "runs": []}
    return out, pages.write_pages(out / "pages"), results


def arguments(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="100,500,1000,2000", help="numbers of targets, comma-separated")
    p.add_argument("--interval", type=float, default=5.0, help="poll and scrape interval, seconds")
    p.add_argument("--cycles", type=int, default=6, help="poll cycles in each measured window")
    p.add_argument("--warmup", type=int, default=2, help="cycles to wait before measuring")
    p.add_argument("--workloads", default=",".join(pages.DEFAULT_WORKLOADS),
                   help=f"comma-separated, of {', '.join(pages.WORKLOADS)}")
    p.add_argument("--no-prometheus", action="store_true", help="measure the exporter alone")
    p.add_argument("--profile", action="store_true",
                   help="after each exporter window, sample one more with py-spy (written next to the results)")
    p.add_argument("--out", type=Path, default=Path("bench/results"))
    args = p.parse_args(argv)
    args.sizes = [int(size) for size in args.sizes.split(",")]
    args.workloads = choices(p, args.workloads, pages.WORKLOADS, "workload")
    return args


def main(argv: list[str]) -> int:
    args = arguments(argv)
    out, page_paths, results = begin(args)
    results["pages"] = {}
    used = dict.fromkeys(name for workload in args.workloads for name in pages.WORKLOADS[workload])
    for name in used:
        text = page_paths[name].read_text()
        results["pages"][name] = {"bytes": len(text.encode()), "parser": parser_figures(text)}
        print(f"parser on {name}: {results['pages'][name]['parser']['speedup']:.0f}x prometheus_client", flush=True)
    for workload in args.workloads:
        with Fleet(workload, [page_paths[name] for name in pages.WORKLOADS[workload]], out / "logs") as fleet:
            for size in args.sizes:
                plan = measure.Plan(size, args.interval, args.cycles, args.warmup,
                                    profile_dir=out / "profiles" / workload if args.profile else None)
                run = {"workload": workload, "targets": size}
                work = out / "work" / f"{workload}-{size}"
                started = time.monotonic()
                run["exporter"] = measure.measure_exporter(fleet, plan, work / "exporter")
                if not args.no_prometheus:
                    run["prometheus"] = measure.measure_prometheus(fleet, plan, work / "prometheus")
                results["runs"].append(run)
                _save(results, out)
                print(f"{workload} N={size}: exporter {run['exporter']['cpu_per_request_us']:.0f} µs/poll, "
                      f"Prometheus {run.get('prometheus', {}).get('cpu_per_request_us') or 0:.0f} µs/scrape "
                      f"({time.monotonic() - started:.0f} s)", flush=True)
    text = report.write(results, out)
    _save(results, out)
    print(text)
    return 0


def _save(results: dict, out: Path) -> None:
    runs = [run[process] for run in results["runs"] for process in ("exporter", "prometheus") if process in run]
    results["other_load_cores"] = sum(r["other_load_cores"] for r in runs) / len(runs) if runs else 0.0
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
