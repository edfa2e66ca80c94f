"""What reading one engine page costs the exporter, step by step: detection, parse, adapt, derive, render.

    python -m bench.reading [--pages sglang-tp2-at-rest,vllm-v1-58k-at-rest] [--targets 2000] [--reference-fold]
                            [--neighbour-mb 64]

Per page (bench/pages.py): each step's CPU per poll, the best of 5 runs of 500 reads of the same
page (warm caches); then whole reads over --targets targets in turn, each target with its own
render cache and history and the page's variants in rotation, as the exporter reads a fleet's
pages (colder caches). `--neighbour-mb M` measures the fleet's read once more beside a process that
sweeps M MB of memory on the other core, as the page server and Prometheus do beside a live exporter
(their caches are shared). Everything else a poll costs (scheduler, fetch, serving the exporter's
page) is measured by path `replay` of bench.paths; docs/performance.md puts the two together.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import re
import subprocess
import sys
import time

from devtools import harness

from kvcache_exporter import adapters, derive, exposition
from kvcache_exporter.contract import FAILURE_REASONS
from kvcache_exporter.runtime import collector
from kvcache_exporter.runtime.target import PollOutcome
from kvcache_exporter.sources import parser
from kvcache_exporter.thresholds import DEFAULT

from . import page_server, pages
from .parser_speed import best_of
from .report import table

DEFAULT_PAGES = ("sglang-tp2-at-rest", "vllm-v1-58k-at-rest")


class Reader:
    """One target's reading of pages, as exporter.runtime.target.Target does it after the fetch."""

    def __init__(self, name: str, url: str | None = None):
        self.name = name
        self.url = url or f"http://127.0.0.1:1/{name}"
        self.prefixes = exposition.Prefixes()
        self.histories: dict = {}
        self.failures = dict.fromkeys(FAILURE_REASONS, 0)
        self.memo: dict = {}  # the target's unchanged histograms (Adapter.adapt)

    def read(self, text: str, now: float | None = None) -> exposition.TargetText:
        adapter = adapters.detect(text)
        snapshot = adapter.adapt(parser.parse(text, adapter.wanted), memo=self.memo)
        now = time.time() if now is None else now
        ranks, self.histories = derive.derive(snapshot, self.histories, now, DEFAULT)
        outcome = PollOutcome(True, snapshot.engine, snapshot.model, snapshot.version, 0.01, now, ranks)
        return exposition.render_target(self.name, {}, self.url, outcome, self.failures, self.prefixes)


def steps(text: str) -> dict[str, float]:
    """µs of CPU per read of `text`, by step, with warm caches."""
    adapter = adapters.detect(text)
    samples = parser.parse(text, adapter.wanted)
    snapshot = adapter.adapt(samples)
    ranks, _ = derive.derive(snapshot, {}, time.time(), DEFAULT)
    outcome = PollOutcome(True, snapshot.engine, snapshot.model, snapshot.version, 0.01, time.time(), ranks)
    reader = Reader("t-0")
    timed = {
        "detect": lambda: adapters.detect(text),
        "parse": lambda: parser.parse(text, adapter.wanted),
        "adapt": lambda: adapter.adapt(samples),
        "derive": lambda: derive.derive(snapshot, {}, 0.0, DEFAULT),
        "render": lambda: exposition.render_target("t-0", {}, reader.url, outcome, reader.failures, reader.prefixes),
    }
    return {step: best_of(function, repeat=5, number=500) * 1e6 for step, function in timed.items()}


def without_histograms(text: str) -> str:
    """`text` without its histogram families: what is left to parse if every unchanged family were skipped, at
    most, since histograms change only when requests finish (the lever docs/performance.md measures)."""
    histograms = set(re.findall(r"(?m)^# TYPE (\S+) histogram$", text))
    return pages.drop_families(text, histograms.__contains__)


_HISTOGRAM_LINE = ("_bucket{", "_sum{", "_count{", "_bucket ", "_sum ", "_count ")


def histograms_still(text: str, first: str) -> str:
    """`text` (a variant of `first`, line for line) with every histogram's lines as in `first`: an engine whose
    requests did not finish between two polls changes its gauges and token counters, not its histograms."""
    return "\n".join(old if any(part in old for part in _HISTOGRAM_LINE) else new
                     for new, old in zip(text.split("\n"), first.split("\n")))


class CollectorTime:
    """CPU time the cyclic garbage collector takes while in use (gc.callbacks)."""

    def __init__(self):
        self.seconds, self._began = 0.0, 0.0

    def __call__(self, phase: str, _info: dict) -> None:
        if phase == "start":
            self._began = time.process_time()
        else:
            self.seconds += time.process_time() - self._began

    def __enter__(self) -> "CollectorTime":
        gc.callbacks.append(self)
        return self

    def __exit__(self, *_) -> None:
        gc.callbacks.remove(self)


def fleet_read(text: str, targets: int, rounds: int = 3, histograms_change: bool = True,
               tuned_collector: bool = True) -> tuple[float, float]:
    """µs of CPU per read, reading `targets` targets in turn, `rounds` times after one warm-up round; every
    value changing from one read of a target to the next, or all but the histograms' values. With the
    collector as the exporter tunes it once its targets exist (exporter/runtime/collector.py), or the
    interpreter's default. Also the share of that CPU the collector took."""
    variants = [body.decode() for body in page_server.variants(text)]
    if not histograms_change:
        variants = [histograms_still(variant, variants[0]) for variant in variants]
    readers = [Reader(f"t-{i}") for i in range(targets)]
    texts = [None] * targets  # kept, as the exporter keeps every target's text
    default_threshold = gc.get_threshold()
    if tuned_collector:  # as the exporter does once its targets exist, before their first poll
        collector.tune()
    with CollectorTime() as collected:
        for turn in range(rounds + 1):
            if turn == 1:
                collected.seconds, start = 0.0, time.process_time()
            for i, reader in enumerate(readers):
                texts[i] = reader.read(variants[(turn + i) % len(variants)])
        spent = time.process_time() - start
    gc.unfreeze()
    gc.set_threshold(*default_threshold)
    return spent / (rounds * targets) * 1e6, collected.seconds / spent


@contextlib.contextmanager
def neighbour(megabytes: int):
    """A process writing a byte in every 64 of `megabytes` MB, over and over, while the block runs."""
    sweep = f"b = bytearray({megabytes} << 20)\nwhile True:\n    b[::64] = bytes(len(b) // 64)"
    process = subprocess.Popen([sys.executable, "-c", sweep])
    try:
        time.sleep(1.0)  # its buffer allocated, its loop running
        yield
    finally:
        process.kill()
        process.wait()


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.reading", description=__doc__.split("\n\n")[0])
    p.add_argument("--pages", default=",".join(DEFAULT_PAGES), help=f"comma-separated, of {', '.join(pages.PAGES)}")
    p.add_argument("--targets", type=int, default=2000, help="targets read in turn for the fleet figure")
    p.add_argument("--neighbour-mb", type=int, default=0,
                   help="also read the fleet beside a process sweeping this many MB of memory (0: not)")
    p.add_argument("--reference-fold", action="store_true",
                   help="adapt with the pure-Python loops (what runs without a C compiler), not the compiled ones")
    args = p.parse_args(argv)
    with harness.reference_fold() if args.reference_fold else contextlib.nullcontext():
        return measure(args)


def measure(args: argparse.Namespace) -> int:
    rows = []
    for name in args.pages.split(","):
        text = pages.PAGES[name]()
        adapter = adapters.detect(text)
        wanted = sum(map(len, parser.parse(text, adapter.wanted).values()))
        by_step = steps(text)
        reference = best_of(lambda: parser.reference_parse(text, adapter.wanted), repeat=5, number=500) * 1e6
        slim = without_histograms(text)
        histogramless = best_of(lambda: parser.parse(slim, adapter.wanted), repeat=5, number=500) * 1e6
        rows.append([name, f"{len(text.encode()) / 1000:.0f} KB", str(wanted),
                     *(f"{by_step[step]:.0f}" for step in by_step), f"{sum(by_step.values()):.0f}",
                     *(f"{micros:.0f} ({share:.0%})" for micros, share in (
                         fleet_read(text, args.targets, tuned_collector=False), fleet_read(text, args.targets))),
                     f"{fleet_read(text, args.targets, histograms_change=False)[0]:.0f}", f"{reference:.0f}",
                     f"{histogramless:.0f}"])
        if args.neighbour_mb:
            with neighbour(args.neighbour_mb):
                rows[-1].append(f"{fleet_read(text, args.targets)[0]:.0f}")
    print(f"Reader: {parser.READER}, adapter: {'python' if args.reference_fold else adapters.ADAPTER}")
    print(table(["page", "size", "lines read", "detect µs", "parse µs", "adapt µs", "derive µs", "render µs",
                 "sum µs", f"a read among {args.targets:,} targets, default collector µs (its share)",
                 "the same, the collector as the exporter tunes it µs (its share)",
                 "the same, histograms unchanged since the target's last read, µs",
                 "parse by the pure-Python reader µs", "parse without the histogram families µs",
                 *([f"the tuned read beside a process sweeping {args.neighbour_mb} MB, µs"] if args.neighbour_mb else [])],
                rows))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
