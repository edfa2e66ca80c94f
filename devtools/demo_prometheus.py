"""The demo exporter and a Prometheus scraping it with the shipped alert rules, until Ctrl-C.

    python -m devtools.demo_prometheus [--port 9090] [--scrape-interval 5s] [--dir DIR]

Prints Prometheus' URL once both are up: the data source for `make dashboards-render`
(which regenerates docs/img/dashboards/ from a run of this).
"""

from __future__ import annotations

import argparse
import signal
import tempfile
import threading
from pathlib import Path

from devtools import harness

RULES = harness.REPO / "alerts" / "kvcache-rules.yml"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m devtools.demo_prometheus", description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=9090, help="Prometheus' port on 127.0.0.1 (%(default)s)")
    parser.add_argument("--scrape-interval", default="5s", help="scrape and rule evaluation interval (%(default)s)")
    parser.add_argument("--dir", type=Path, help="where the logs and the TSDB go (a temporary directory if unset)")
    args = parser.parse_args(argv)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    with tempfile.TemporaryDirectory(prefix="kvcache-demo-") as scratch:
        work = args.dir or Path(scratch)
        work.mkdir(parents=True, exist_ok=True)
        with harness.exporter(work, "--demo") as exporter:
            config = {
                "global": {"scrape_interval": args.scrape_interval, "evaluation_interval": args.scrape_interval},
                "rule_files": [str(RULES)],
                "scrape_configs": [{"job_name": "kvcache-exporter",
                                    "static_configs": [{"targets": [exporter.url.removeprefix("http://")]}]}],
            }
            with harness.prometheus(work / "prometheus", config, port=args.port) as prometheus:
                print(f"demo exporter {exporter.url}, Prometheus {prometheus.url} (scrape every {args.scrape_interval}); "
                      f"logs in {work}", flush=True)
                try:
                    stop.wait()
                except KeyboardInterrupt:
                    pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
