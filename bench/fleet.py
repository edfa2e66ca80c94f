"""The fleet the benchmark polls: one page server process (bench/page_server.py) with N targets,
and a count of the requests it has received, read from the kernel's TCP statistics.

Counting at the server counts the exporter's polls and Prometheus' scrapes alike, and a skipped
poll is not counted. A GET without a body is one write, hence one TCP segment, and neither client
pipelines, so the segments with data that the server's connections have received (`data_segs_in`,
kept by the kernel per connection) are the requests. Both clients keep their connections open;
`connections` shows it (a connection closed meanwhile takes its count with it).
"""

from __future__ import annotations

import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from devtools import harness

_REQUESTS = re.compile(r"\bdata_segs_in:(\d+)")


@dataclass(frozen=True)
class Traffic:
    requests: int
    connections: int


class Fleet:
    def __init__(self, name: str, page_paths: list[Path], log_dir: Path):
        self.port = harness.free_port()
        argv = [sys.executable, "-m", "bench.page_server", "--port", str(self.port),
                "--pages", ",".join(str(path) for path in page_paths)]
        log_dir.mkdir(parents=True, exist_ok=True)
        self.process = harness.Process(f"page-server-{name}", argv, log_dir, self.url(0)).wait_ready()

    @property
    def pid(self) -> int:
        return self.process.proc.pid

    def url(self, index: int) -> str:
        return f"http://127.0.0.1:{self.port}/t/{index}"

    def traffic(self) -> Traffic:
        out = subprocess.run(["ss", "-tinH", "state", "established", f"( sport = :{self.port} )"],
                             capture_output=True, text=True, check=True).stdout
        counts = [int(value) for value in _REQUESTS.findall(out)]
        return Traffic(sum(counts), len(counts))

    def stop(self) -> None:
        self.process.stop()

    def __enter__(self) -> "Fleet":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
