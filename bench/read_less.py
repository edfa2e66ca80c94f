"""Reading less (issue #33, lever 2): bytes fetched and reading time per page, whole and as the engine's
answer to `?name[]=` with the adapter's names, for every engine fixture.

    python -m bench.read_less [--repeat 5] [--number 200]

Per page of tests/fixtures: its engine (detected), what that engine's server does with the filter
(ENGINE_SERVERS, from each engine's source), the page's bytes whole and filtered (what prometheus_client
answers: devtools/name_filter.py), and the CPU of reading it (best of `repeat` runs of `number` reads):
whole as every poll reads it today (detect the engine, then parse the wanted lines), and filtered as a
poll reads an honoured answer (the adapter known, parse). The first filtered answer after a whole page is
also checked for other series once (`parser.unread_lines`): its cost is the last column.
"""

from __future__ import annotations

import argparse
import sys

from devtools import harness, name_filter
from kvcache_exporter import adapters
from kvcache_exporter.sources import parser

from .parser_speed import best_of
from .report import table

# What each engine's /metrics server does with `?name[]=`, read in its source (docs/performance.md).
ENGINE_SERVERS = {
    "vllm": "ignores it: /metrics is prometheus-fastapi-instrumentator's route, the whole registry (vLLM 0.32)",
    "sglang": "answers no series: prometheus_client's ASGI app on a multiprocess registry (0.23 on; before, ignores it)",
    "trtllm": "answers no series: as SGLang (trtllm-serve's /prometheus/metrics)",
    "lmdeploy": "honours it: prometheus_client's ASGI app on the default registry (prometheus_client 0.23 on)",
    "lmcache": "ignores it: generate_latest(REGISTRY) in its own route",
    "triton": "ignores it: Triton's C++ metrics endpoint",
    "dynamo": "ignores it: Dynamo's Rust HTTP server",
}


def measure(text: str, repeat: int, number: int) -> dict | None:
    adapter = adapters.detect(text)
    if adapter is None:
        return None
    wanted = adapter.wanted
    filtered = name_filter.answer(text, wanted)
    found = parser.parse(text, wanted)
    read = sum(map(len, found.values()))
    return {
        "engine": adapter.engine,
        "whole_bytes": len(text.encode()),
        "filtered_bytes": len(filtered.encode()),
        "samples_read": read,
        "samples_on_page": read + parser.unread_lines(text, found),
        "whole_us": best_of(lambda: parser.parse(text, adapters.detect(text).wanted), repeat, number) * 1e6,
        "filtered_us": best_of(lambda: parser.parse(filtered, wanted), repeat, number) * 1e6,
        "check_us": best_of(lambda: parser.unread_lines(filtered, parser.parse(filtered, wanted)), repeat, number)
        * 1e6,
    }


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.read_less", description=__doc__.split("\n\n")[0])
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--number", type=int, default=200)
    args = p.parse_args(argv)
    rows = []
    for path in sorted(harness.FIXTURES.glob("*.txt")):
        figures = measure(path.read_text(), args.repeat, args.number)
        if figures is None:
            continue
        rows.append([path.name, figures["engine"], f"{figures['whole_bytes'] / 1000:.1f}",
                     f"{figures['filtered_bytes'] / 1000:.1f}",
                     f"{figures['filtered_bytes'] / figures['whole_bytes']:.2f}",
                     f"{figures['samples_read']} / {figures['samples_on_page']}",
                     f"{figures['whole_us']:.0f}", f"{figures['filtered_us']:.0f}",
                     f"{figures['filtered_us'] / figures['whole_us']:.2f}",
                     f"{figures['check_us'] - figures['filtered_us']:.0f}"])
    print(table(["page", "engine", "whole KB", "filtered KB", "ratio", "samples read / on the page",
                 "read whole µs (detect + parse)", "read filtered µs (parse)", "ratio",
                 "first answer's check µs (once)"], rows))
    print()
    print(table(["engine", "its /metrics server and `?name[]=`"], [[e, what] for e, what in ENGINE_SERVERS.items()]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
