"""The demo exporter and a Prometheus scraping it with the shipped alert rules, until Ctrl-C; or, with --render,
both dashboards drawn over what it gathered, then everything stopped (`make dashboards-demo`).

    python -m devtools.demo_prometheus [--port 9090] [--scrape-interval 5s] [--dir DIR]
    python -m devtools.demo_prometheus --render DIR [--warm-up 180]

Prints Prometheus' URL once both are up: a data source for `make dashboards-render`.
`python -m devtools.render_docs` runs the same stack to redraw the pictures in docs/dashboards.md.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Iterator

from devtools import harness

RULES = harness.REPO / "alerts" / "kvcache-rules.yml"
# As the compose stack scrapes the exporter and as its Grafana data source says (timeInterval).
SCRAPE_INTERVAL = "5s"
# Enough for kv-saturation (at the demo's speed 4) to fill its pool, queue for KV and preempt.
WARM_UP_S = 180.0


@contextlib.contextmanager
def demo_stack(work: Path, port: int | None = None, scrape_interval: str = SCRAPE_INTERVAL) -> Iterator[str]:
    """`kvcache-exporter --demo` and a Prometheus scraping it; yields Prometheus' base URL."""
    work.mkdir(parents=True, exist_ok=True)
    with harness.exporter(work, "--demo") as exporter:
        config = {
            "global": {"scrape_interval": scrape_interval, "evaluation_interval": scrape_interval},
            "rule_files": [str(RULES)],
            "scrape_configs": [{"job_name": "kvcache-exporter",
                                "static_configs": [{"targets": [exporter.url.removeprefix("http://")]}]}],
        }
        with harness.prometheus(work / "prometheus", config, port=port) as prometheus:
            yield prometheus.url


def render(prometheus_url: str, out: Path, range_text: str) -> int:
    """`make dashboards-render` from that Prometheus into `out` over the last `range_text`; its exit status."""
    return subprocess.run(["make", "-s", "dashboards-render", f"PROMETHEUS={prometheus_url}", f"RENDER_DIR={out}",
                           f"RENDER_ARGS=--range {range_text}"], cwd=harness.REPO).returncode


def render_demo(out: Path, warm_up: float, work: Path) -> int:
    """The demo stack for `warm_up` seconds, then both dashboards drawn over the time Prometheus has data for (not
    the dashboards' saved hour, which would squeeze it into the right edge)."""
    with demo_stack(work, port=harness.free_port()) as url:
        started = time.monotonic()
        print(f"demo exporter and Prometheus {url} up; drawing both dashboards in {warm_up:g} s", flush=True)
        time.sleep(warm_up)
        status = render(url, out, f"{math.ceil(time.monotonic() - started)}s")
    print(f"both dashboards drawn in {out}/ (displayed.json says what each panel shows)" if status == 0
          else f"make dashboards-render exited {status}", flush=True)
    return status


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m devtools.demo_prometheus", description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=9090, help="Prometheus' port on 127.0.0.1 (%(default)s)")
    parser.add_argument("--scrape-interval", default=SCRAPE_INTERVAL, help="scrape and rule evaluation interval (%(default)s)")
    parser.add_argument("--dir", type=Path, help="where the logs and the TSDB go (a temporary directory if unset)")
    parser.add_argument("--render", type=Path, metavar="DIR",
                        help="draw both dashboards into DIR after --warm-up seconds, then stop everything")
    parser.add_argument("--warm-up", type=float, default=WARM_UP_S, help="seconds of data before drawing (%(default)s)")
    args = parser.parse_args(argv)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    with tempfile.TemporaryDirectory(prefix="kvcache-demo-") as scratch:
        work = args.dir or Path(scratch)
        if args.render:
            return render_demo(args.render, args.warm_up, work)
        with demo_stack(work, args.port, args.scrape_interval) as url:
            print(f"Prometheus {url} scrapes the demo exporter every {args.scrape_interval}; logs in {work}", flush=True)
            try:
                stop.wait()
            except KeyboardInterrupt:
                pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
