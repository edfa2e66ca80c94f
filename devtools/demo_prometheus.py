"""The demo exporter and a Prometheus scraping it with the shipped alert rules, until Ctrl-C.

    python -m devtools.demo_prometheus [--port 9090] [--scrape-interval 5s] [--dir DIR]

Prints Prometheus' URL once both are up: a data source for `make dashboards-render`.
`python -m devtools.render_docs` runs the same stack to redraw the pictures in docs/dashboards.md.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import tempfile
import threading
from pathlib import Path
from typing import Iterator

from devtools import harness

RULES = harness.REPO / "alerts" / "kvcache-rules.yml"
# As the compose stack scrapes the exporter and as its Grafana data source says (timeInterval).
SCRAPE_INTERVAL = "5s"


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m devtools.demo_prometheus", description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=9090, help="Prometheus' port on 127.0.0.1 (%(default)s)")
    parser.add_argument("--scrape-interval", default=SCRAPE_INTERVAL, help="scrape and rule evaluation interval (%(default)s)")
    parser.add_argument("--dir", type=Path, help="where the logs and the TSDB go (a temporary directory if unset)")
    args = parser.parse_args(argv)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    with tempfile.TemporaryDirectory(prefix="kvcache-demo-") as scratch:
        work = args.dir or Path(scratch)
        with demo_stack(work, args.port, args.scrape_interval) as url:
            print(f"Prometheus {url} scrapes the demo exporter every {args.scrape_interval}; logs in {work}", flush=True)
            try:
                stop.wait()
            except KeyboardInterrupt:
                pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
