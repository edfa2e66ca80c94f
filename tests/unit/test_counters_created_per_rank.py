"""A counter the engine creates at its first increment is created rank by rank: a data-parallel rank that
has not counted yet has counted 0, also once another rank's counter is on the page (issue #28)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from kvcache_exporter import adapters
from kvcache_exporter.simulator.exposition import FLAVORS, EngineState
from kvcache_exporter.simulator.scenarios import ScenarioRun, load_scenario, override_engine
from kvcache_exporter.sources import parser


def test_a_rank_yet_to_retract_reads_zero_next_to_a_rank_that_has_retracted():
    # The end-to-end truth test's saturated SGLang pool (two DP ranks, half the pool each), stopped at the
    # first second in which a rank retracted: the other rank has not.
    scenario = override_engine(load_scenario("kv-saturation"), {"num_blocks": 512})
    run = ScenarioRun(scenario, FLAVORS["sglang"].reporting, seed=2, dp=2)
    while not any(model.counters.preemptions for model in run.models):
        run.advance_to(run.now + 1)
    retracted = {str(rank): model.counters.preemptions for rank, model in enumerate(run.models)}
    assert sorted(retracted.values())[0] == 0 < sorted(retracted.values())[1], retracted

    state = EngineState(model_name="org/model-7b", tp=1, created_unix=0.0,
                        ranks=tuple(model.snapshot() for model in run.models))
    registry = CollectorRegistry()
    registry.register(FLAVORS["sglang"].make_collector(lambda: state, 0))
    page = generate_latest(registry).decode()
    # SGLang's shape: the counter's child exists for the rank that retracted only.
    assert sum(line.startswith("sglang:num_retracted_requests_total{") for line in page.splitlines()) == 1

    adapter = adapters.detect(page)
    snapshot = adapter.adapt(parser.parse(page, adapter.wanted))
    assert {rank: values.counters.get("preemptions_total") for rank, values in snapshot.ranks.items()} == retracted
