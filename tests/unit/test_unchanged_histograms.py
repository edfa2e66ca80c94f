"""A target's histograms that did not change since its last poll are not read again: the adapter's memo hands the
last poll's Histogram objects back and the renderer its lines. The output must be what reading afresh gives, at
every poll of a sequence whose pages repeat and change as an engine's do."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from kvcache_exporter import adapters, derive, exposition
from kvcache_exporter.contract import FAILURE_REASONS
from kvcache_exporter.runtime.target import PollOutcome
from kvcache_exporter.simulator.exposition import FLAVORS, EngineState
from kvcache_exporter.simulator.scenarios import ScenarioRun, load_scenario
from kvcache_exporter.sources import parser
from kvcache_exporter.thresholds import DEFAULT

# Polls at these simulated seconds: each page read twice in a row (an engine with no request finished between two
# polls repeats its histograms), then the first page again (a restarted engine's page differs from the last one).
POLLS = (60, 60, 120, 120, 180, 60)


def pages(flavor: str) -> list[str]:
    run = ScenarioRun(load_scenario("kv-saturation"), FLAVORS[flavor].reporting, seed=0, dp=2)
    by_moment = {}
    for moment in sorted(set(POLLS)):
        run.advance_to(moment)
        state = EngineState(model_name="m", tp=2, created_unix=0.0, ranks=tuple(m.snapshot() for m in run.models))
        registry = CollectorRegistry()
        registry.register(FLAVORS[flavor].make_collector(lambda state=state: state, 0))
        by_moment[moment] = generate_latest(registry).decode()
    return [by_moment[moment] for moment in POLLS]


def rendered(snapshot, prefixes: exposition.Prefixes) -> bytes:
    ranks, _ = derive.derive(snapshot, {}, 0.0, DEFAULT)
    outcome = PollOutcome(True, snapshot.engine, snapshot.model, "", 0.01, 1.0, ranks)
    text = exposition.render_target("t", {}, "http://h/metrics", outcome, dict.fromkeys(FAILURE_REASONS, 0),
                                    prefixes)
    return b"".join(exposition.render([text], now=1.0, staleness=15.0))


@pytest.mark.parametrize("flavor", ["vllm-v1", "sglang"])
def test_reused_histograms_render_as_read_afresh(flavor):
    memo: dict = {}
    prefixes = exposition.Prefixes()
    last = None
    for index, text in enumerate(pages(flavor)):
        path = f"poll {index} (t={POLLS[index]} s)"
        adapter = adapters.detect(text)
        samples = parser.parse(text, adapter.wanted)
        fresh = adapter.adapt(samples)
        reused = adapter.adapt(samples, memo=memo)
        assert reused == fresh, path
        assert rendered(reused, prefixes) == rendered(fresh, exposition.Prefixes()), path
        histograms = {(rank, name): histogram for rank, values in reused.ranks.items()
                      for name, histogram in values.histograms.items()}
        assert {name for _, name in histograms} == {"time_to_first_token_seconds", "inter_token_latency_seconds",
                                                    "queue_time_seconds", "e2e_request_latency_seconds"}
        assert {rank for rank, _ in histograms} == {"0", "1"}
        same_page = index > 0 and POLLS[index - 1] == POLLS[index]
        for key, histogram in histograms.items():
            # The same page: every histogram object again; another page: read anew (the simulated engines finish
            # requests in every minute of the scenario, so every histogram's count differs).
            assert (last is not None and histogram is last[key]) == same_page, (path, key)
        last = histograms
