"""/metrics at fleet size, in isolation (no polls competing for the CPU): the exporter's join of
text rendered at poll time, against prometheus_client building a Metric object for every sample
at every scrape and writing them out with generate_latest; and the gzip of that body at
compression levels 1 (what the exporter uses) and 6 (zlib's default).

    python -m bench.render [--targets 100,500,1000,2000] [--page vllm-v1-35k]

Every target serves the page under its own name with values of its own (as many variants as
targets, so that gzip sees what a fleet sends), read once through the exporter's pipeline.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import zlib
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from kvcache_exporter import exposition
from kvcache_exporter.runtime import server

from . import page_server, pages
from .reading import Reader

STALENESS = 60.0


def target_texts(page: str, count: int, now: float) -> list[exposition.TargetText]:
    """`count` targets named t-0, t-1, ..., target i having last read variant i of `page`."""
    return [Reader(f"t-{index}", f"http://10.0.0.1:8000/t/{index}/metrics").read(page_server.variant(page, index), now)
            for index in range(count)]


def gzip_seconds(parts: list[bytes], level: int) -> tuple[float, int]:
    """CPU seconds and compressed size of the body at this level, in blocks as the server compresses it."""
    compressed = 0

    def run() -> None:
        nonlocal compressed
        compressor = zlib.compressobj(level, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
        compressed = sum(len(compressor.compress(block)) for block in server._blocks(parts))
        compressed += len(compressor.flush())

    return cpu_seconds(run), compressed


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
    one = b"".join(exposition.render(target_texts(page, 1, now), now, STALENESS)).decode()
    print(f"/metrics of N targets serving {args.page}, CPU per scrape:")
    print(f"{'targets':>8} {'MB':>7} {'exporter join ms':>17} {'prometheus_client ms':>21} {'ratio':>7} "
          f"{'gzip-1 ms':>10} {'gzip-1 MB':>10} {'gzip-6 ms':>10} {'gzip-6 MB':>10}")
    for count in (int(n) for n in args.targets.split(",")):
        texts = target_texts(page, count, now)
        parts = exposition.render(texts, now, STALENESS)
        body = b"".join(parts)
        registry = CollectorRegistry(auto_describe=False)
        registry.register(RebuildingCollector(one, count))
        theirs_body = generate_latest(registry)
        if _sample_lines(theirs_body) != _sample_lines(body):
            raise SystemExit("the two renderings hold different numbers of samples")
        ours = cpu_seconds(lambda: exposition.render(texts, now, STALENESS))
        theirs = cpu_seconds(lambda: generate_latest(registry), rounds=1)
        fast, fast_size = gzip_seconds(parts, 1)
        default, default_size = gzip_seconds(parts, 6)
        print(f"{count:8d} {len(body) / 1e6:7.1f} {ours * 1e3:17.1f} {theirs * 1e3:21.0f} {theirs / ours:6.0f}x "
              f"{fast * 1e3:10.0f} {fast_size / 1e6:10.2f} {default * 1e3:10.0f} {default_size / 1e6:10.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
