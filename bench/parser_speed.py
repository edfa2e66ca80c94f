"""The selective parser against prometheus_client's on the same pages: MB/s and the speed-up.

    python -m bench.parser_speed [PAGE ...]

Both parsers must return the same samples for the names the adapter reads (checked before timing).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from kvcache_exporter import adapters
from kvcache_exporter.sources import parser

FIXTURES = Path(__file__).resolve().parents[1] / "tests" / "fixtures"
DEFAULT_PAGES = ("vllm-v1.txt", "vllm-dp-multiproc.txt", "sglang-0.5.txt")


def best_of(function, repeat: int, number: int) -> float:
    """CPU seconds of this process per call, the best of `repeat` runs of `number` calls (the least
    disturbed run; CPU time rather than wall time, which other load on a shared machine stretches)."""
    best = float("inf")
    for _ in range(repeat):
        start = time.process_time()
        for _ in range(number):
            function()
        best = min(best, (time.process_time() - start) / number)
    return best


def oracle(text: str) -> list:
    return [s for family in text_string_to_metric_families(text) for s in family.samples]


def check_equal(text: str, wanted: frozenset[str]) -> int:
    ours = sorted((s.name, sorted(s.labels.items()), repr(s.value))
                  for samples in parser.parse(text, wanted).values() for s in samples)
    theirs = sorted((s.name, sorted(s.labels.items()), repr(float(s.value))) for s in oracle(text) if s.name in wanted)
    if ours != theirs:
        raise SystemExit("the parsers disagree: not timing")
    return len(ours)


def main(argv: list[str]) -> int:
    pages = [Path(p) for p in argv] or [FIXTURES / name for name in DEFAULT_PAGES]
    print(f"{'page':28} {'KB':>6} {'samples':>8} {'ours ms':>8} {'ours MB/s':>10} {'p_c ms':>8} {'p_c MB/s':>9} "
          f"{'speed-up':>9}")
    for path in pages:
        text = path.read_text()
        adapter = adapters.detect(text)
        wanted = adapter.wanted
        count = check_equal(text, wanted)
        ours = best_of(lambda: parser.parse(text, wanted), repeat=5, number=200)
        theirs = best_of(lambda: oracle(text), repeat=3, number=10)
        megabytes = len(text.encode()) / 1e6
        print(f"{path.name:28} {len(text) / 1024:6.1f} {count:8d} {ours * 1e3:8.3f} {megabytes / ours:10.1f} "
              f"{theirs * 1e3:8.2f} {megabytes / theirs:9.2f} {theirs / ours:8.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
