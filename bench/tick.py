"""The scheduler's tick against the exporter's CPU per poll: how many polls start together, and so
how warm the interpreter's caches are when their pages are read.

    python -m bench.tick [--ticks 0.01,0.05,0.25,0.5] [--targets 2000] [--page sglang-tp2]

For each tick, one exporter process (with `exporter.runtime.scheduler.TICK` set before it starts) polls N
targets of the page server every 5 s; after a warm-up, its CPU over a window is divided by the
polls the page server counted. Each row is one window: run it twice to see the spread.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from devtools import harness

from . import pages, procstat
from .fleet import Fleet

WARM_UP = 12.0  # seconds: the first round and two intervals
WINDOW = 15.0  # seconds: three intervals


def cpu_per_poll(fleet: Fleet, config: Path, tick: float) -> tuple[float, int]:
    """(µs of CPU per poll, polls) of an exporter whose scheduler ticks every `tick` seconds."""
    port = harness.free_port()
    code = ("import sys; import kvcache_exporter.runtime.scheduler as scheduler; "
            "from kvcache_exporter.commands import main; "
            f"scheduler.TICK = {tick!r}; "
            f"sys.exit(main(['--config', {str(config)!r}, '--listen', '127.0.0.1:{port}']))")
    process = subprocess.Popen([sys.executable, "-c", code], cwd=harness.REPO, stderr=subprocess.DEVNULL)
    try:
        time.sleep(WARM_UP)
        polls, cpu = fleet.traffic().requests, procstat.cpu_seconds(process.pid)
        time.sleep(WINDOW)
        polls, cpu = fleet.traffic().requests - polls, procstat.cpu_seconds(process.pid) - cpu
    finally:
        process.terminate()
        process.wait()
    return cpu / polls * 1e6, polls


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.tick", description=__doc__.split("\n\n")[0])
    p.add_argument("--ticks", default="0.01,0.05,0.25,0.5")
    p.add_argument("--targets", type=int, default=2000)
    p.add_argument("--page", default="sglang-tp2", choices=sorted(pages.PAGES))
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as scratch:
        paths = pages.write_pages(Path(scratch) / "pages")
        with Fleet("tick", [paths[args.page]], Path(scratch) / "logs") as fleet:
            config = Path(scratch) / "exporter.yml"
            config.write_text("poll_interval: 5s\ntargets:\n" + "".join(
                f"  - name: t{i}\n    url: {fleet.url(i)}\n" for i in range(args.targets)))
            print(f"{args.targets} targets serving {args.page}, every 5 s:")
            print(f"{'tick s':>7} {'polls':>6} {'µs CPU/poll':>12}")
            for tick in (float(t) for t in args.ticks.split(",")):
                micros, polls = cpu_per_poll(fleet, config, tick)
                print(f"{tick:7.2f} {polls:6d} {micros:12.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
