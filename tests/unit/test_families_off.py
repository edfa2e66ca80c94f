"""`families: {GROUP: false}`: a contract group turned off is never exposed, its histograms are not even read, and
kvcache_exporter_group_enabled says which groups are on."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from devtools import harness
from kvcache_exporter import adapters, config as cfg, contract, derive, exposition
from kvcache_exporter.runtime.app import ExporterState
from kvcache_exporter.runtime.target import PollOutcome
from kvcache_exporter.sources import parser
from kvcache_exporter.thresholds import DEFAULT

PAGE = (harness.FIXTURES / "vllm-v1.txt").read_text()
LATENCY = {"time_to_first_token_seconds", "inter_token_latency_seconds", "queue_time_seconds",
           "e2e_request_latency_seconds"}


def configured(tmp_path, text: str) -> cfg.Config:
    path = tmp_path / "exporter.yml"
    path.write_text(text)
    return cfg.resolve({"config": str(path)}, {})


def exposed(config: cfg.Config) -> set[str]:
    adapter = adapters.detect(PAGE)
    snapshot = adapter.adapt(parser.parse(PAGE, adapter.wanted), config.adapted_buckets)
    ranks, _ = derive.derive(snapshot, {}, 0.0, DEFAULT)
    outcome = PollOutcome(True, snapshot.engine, snapshot.model, "", 0.01, 1.0, ranks)
    text = exposition.render_target("t", {}, "http://h/metrics", outcome, dict.fromkeys(contract.FAILURE_REASONS, 0),
                                    exposition.Prefixes())
    body = b"".join(exposition.render([text], 1.0, 15.0, ExporterState().lines(0, 0, groups_off=config.groups_off),
                                      config.hidden_families)).decode()
    return {family.name.removeprefix(contract.PREFIX) for family in text_string_to_metric_families(body)}


def test_a_group_turned_off_is_not_exposed_and_its_histograms_not_read(tmp_path):
    on = exposed(configured(tmp_path, "targets: []"))
    assert LATENCY <= on and "usage_ratio" in on and "pressure_state" in on
    config = configured(tmp_path, "families: {latency: false, pool: true}")
    assert config.groups_off == {"latency"} and config.hidden_families == LATENCY
    assert exposed(config) == on - LATENCY
    adapter = adapters.detect(PAGE)
    snapshot = adapter.adapt(parser.parse(PAGE, adapter.wanted), config.adapted_buckets)
    assert snapshot.ranks["0"].histograms == {}  # not read, not only not shown
    assert snapshot.ranks["0"].gauges["usage_ratio"] > 0


def test_the_enabled_groups_series(tmp_path):
    config = configured(tmp_path, "families: {latency: false, offload: false}")
    lines = ExporterState().lines(0, 0, groups_off=config.groups_off)["exporter_group_enabled"]
    values = {sample.labels["group"]: sample.value for family in text_string_to_metric_families(lines)
              for sample in family.samples}
    assert values == {"pool": 1, "pressure": 1, "latency": 0, "offload": 0, "transfer": 1, "events": 1}
