"""/metrics at fleet size, in isolation (no polls competing for the CPU): the exporter's join of
text rendered at poll time, against prometheus_client building a Metric object for every sample
at every scrape and writing them out with generate_latest.

    python -m bench.render [--targets 100,500,1000,2000] [--page vllm-v1-35k]

Every target serves the same page under its own name, read once through the exporter's pipeline.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from exporter import adapters, derive, exposition, parser
from exporter.target import FAILURE_REASONS, PollOutcome
from exporter.thresholds import DEFAULT

from . import pages

STALENESS = 60.0


def target_texts(page: str, count: int, now: float) -> list[exposition.TargetText]:
    """`count` targets named t-0, t-1, ... whose last poll read `page`."""
    adapter = adapters.detect(page)
    snapshot = adapter.adapt(parser.parse(page, adapter.wanted))
    ranks, _ = derive.derive(snapshot, {}, now, DEFAULT, None)
    outcome = PollOutcome(True, snapshot.engine, snapshot.model, snapshot.version, 0.01, now, ranks)
    failures = dict.fromkeys(FAILURE_REASONS, 0)
    return [exposition.render_target(f"t-{i}", {}, f"http://10.0.0.1:8000/t/{i}/metrics", outcome, failures,
                                     exposition.Prefixes()) for i in range(count)]


class RebuildingCollector:
    """The same series as the exporter's text, as prometheus_client would serve them from a custom
    collector: new Metric objects, one sample at a time, at every collect()."""

    def __init__(self, one_target_text: str, count: int):
        families = list(text_string_to_metric_families(one_target_text))
        self._families = [(family.name, family.documentation, family.type,
                           [(s.name, s.labels, s.value) for s in family.samples]) for family in families]
        self._names = [f"t-{i}" for i in range(count)]

    def collect(self):
        for name, documentation, kind, samples in self._families:
            metric = Metric(name, documentation, kind)
            for target in self._names:
                for sample_name, labels, value in samples:
                    metric.add_sample(sample_name, {**labels, "target": target}, value)
            yield metric


def cpu_seconds(function, rounds: int = 3) -> float:
    best = float("inf")
    for _ in range(rounds):
        started = time.process_time()
        function()
        best = min(best, time.process_time() - started)
    return best


def _sample_lines(body: bytes) -> int:
    return sum(1 for line in body.splitlines() if line and not line.startswith(b"#"))


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.render", description=__doc__.split("\n\n")[0])
    p.add_argument("--targets", default="100,500,1000,2000")
    p.add_argument("--page", default="vllm-v1-35k", choices=sorted(pages.PAGES))
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as scratch:
        page = pages.write_pages(Path(scratch))[args.page].read_text()
    now = time.time()
    one = exposition.render(target_texts(page, 1, now), now, STALENESS).decode()
    print(f"/metrics of N targets serving {args.page}, CPU per scrape:")
    print(f"{'targets':>8} {'MB':>7} {'exporter join ms':>17} {'prometheus_client ms':>21} {'ratio':>7}")
    for count in (int(n) for n in args.targets.split(",")):
        texts = target_texts(page, count, now)
        body = exposition.render(texts, now, STALENESS)
        registry = CollectorRegistry(auto_describe=False)
        registry.register(RebuildingCollector(one, count))
        theirs_body = generate_latest(registry)
        if _sample_lines(theirs_body) != _sample_lines(body):
            raise SystemExit("the two renderings hold different numbers of samples")
        ours = cpu_seconds(lambda: exposition.render(texts, now, STALENESS))
        theirs = cpu_seconds(lambda: generate_latest(registry), rounds=1)
        print(f"{count:8d} {len(body) / 1e6:7.1f} {ours * 1e3:17.1f} {theirs * 1e3:21.0f} {theirs / ours:6.0f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
