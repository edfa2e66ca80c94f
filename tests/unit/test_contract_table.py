"""exporter/contract.py's table is the one list of kvcache_* families: every family any consumer names
(the exposition of every fixture page and of a KV event stream, the exporter's own series, the
dashboards, the rules, docs/metrics.md, `top`, the adapters) is in it, every family in it has an emitter,
and the exposed series carry the labels and label values the table gives them."""

from __future__ import annotations

import asyncio
import json
import re

import pytest
import yaml

from devtools import harness
from devtools import kvevents_wire as wire
from devtools import lint_dashboards
from kvcache_exporter import adapters, config, contract, exposition
from kvcache_exporter.runtime import process_series
from kvcache_exporter.runtime.app import ExporterState
from kvcache_exporter.fleet import FleetIndex
from kvcache_exporter.runtime.subscriber import EventStream, fleet_texts
from kvcache_exporter.runtime.target import new_target
from kvcache_exporter.top import source as top_source
from kvcache_exporter.top.rows import build_rows
from kvcache_exporter.top.rates import RateWindow

NAME = re.compile(r"\bkvcache_[a-z0-9_]+")
STATIC = {"cluster": "test"}
# The label values the table's enumerations allow, by label (`state` takes every value on every pool).
LABEL_VALUES = {"state": set(contract.PRESSURE_STATES), "tier": set(contract.TIERS),
                "source": set(contract.HIT_SOURCES), "direction": set(contract.TRANSFER_DIRECTIONS),
                "role": set(contract.ROLES), "stage": set(contract.TRANSFER_STAGES),
                "kind": set(contract.TRANSFER_FAILURE_KINDS)}
REASONS = {"target_scrape_failures_total": contract.FAILURE_REASONS,
           "events_dropped_total": contract.EVENT_DROP_REASONS, "events_ignored_total": contract.EVENT_IGNORED_REASONS}


def outside_the_table(names, families: bool = False) -> list[str]:
    """The series names that belong to no family of the table; with `families`, names of families (a
    histogram by its own name) are known too."""
    return sorted({name for name in names if contract.family_of(name) is None
                   and not (families and name.removeprefix(contract.PREFIX) in contract.FAMILIES)})


@pytest.fixture(scope="module")
def exposed(tmp_path_factory) -> str:
    """The exporter's pipeline over every fixture page (one with a model architecture), a KV event stream
    that received batches, and the exporter's own series: one /metrics body."""
    pages = sorted(p.name for p in harness.FIXTURES.glob("*.txt"))
    routes = {f"/{name}": harness.page((harness.FIXTURES / name).read_text()) for name in pages}
    with harness.PageServer(routes) as server:
        targets = [{"name": name, "url": server.url(f"/{name}"), **target_config(name)} for name in pages]
        targets.append({"name": "architecture", "url": server.url("/vllm-v1.txt"),
                        "model_architecture": {"layers": 32, "kv_heads": 8, "head_dim": 128},
                        "kv_events": {"endpoint": "tcp://127.0.0.1:5557"}})
        path = tmp_path_factory.mktemp("contract") / "exporter.yml"
        path.write_text(yaml.safe_dump({"labels": STATIC, "targets": targets}))
        settings = config.build(str(path), config.load_file(str(path)))
        polled = [new_target(target, settings) for target in settings.targets]

        async def poll_all():
            await asyncio.gather(*(target.poll() for target in polled))
            for target in polled:
                target.close()

        asyncio.run(poll_all())
    assert all(target.outcome.up for target in polled)
    with_events = polled[-1]
    stream = EventStream(with_events, 0, "tcp://127.0.0.1:5557", None, with_events.config.kv_events)
    stream.fleet = FleetIndex(1000)  # `fleet_index: {enabled: true}`: the model's fleet series too
    # The GPU pool's blocks, and a CPU tier's (vLLM's offload: a capacity miss of the tier, a block it served).
    events = [[wire.stored("vllm-map", [1, 2, 3])], [wire.removed("vllm-map", [1, 2])],
              [wire.stored("vllm-map", [1])],
              [wire.stored("vllm-map", [2, 4], medium="CPU"), wire.removed("vllm-map", [4], medium="CPU")],
              [wire.stored("vllm-map", [4], medium="CPU"), wire.stored("vllm-map", [2])]]
    for seq, batch in enumerate(events):
        stream._process(seq, wire.batch("vllm-map", 1000.0 + seq, batch))
    texts = [target.text for target in polled] + [stream.render(stream.pool_rank)]
    texts += fleet_texts(stream.fleet, exposition.Prefixes(), settings.labels)
    rendered = {family for text in texts for family in (*text.status, *text.series)}
    # What the renderers produce but the table lacks would be left out of the page without a word.
    assert sorted(rendered - set(contract.FAMILIES)) == []
    own = ExporterState().lines(probed_targets=0, probe_evictions=0) | process_series.lines()
    # A worker process's share, as the serving process joins it (exporter/runtime/worker.py).
    texts.append(exposition.TargetText({name: text.encode() for name, text in process_series.lines(1).items()}))
    return b"".join(exposition.render(texts, with_events.outcome.last_success, 60.0, own)).decode()


def target_config(page: str) -> dict:
    """The configuration a fixture page's expectations give its target (the role a page does not name)."""
    expected = harness.FIXTURES / f"{page}.expected.yml"
    return yaml.safe_load(expected.read_text()).get("target_config", {}) if expected.is_file() else {}


def samples(text: str) -> list[tuple[str, dict[str, str]]]:
    from prometheus_client.parser import text_string_to_metric_families

    return [(s.name, s.labels) for family in text_string_to_metric_families(text) for s in family.samples]


def consumers(exposition_text: str) -> dict[str, set[str]]:
    """Every kvcache_* name each consumer names."""
    dashboards = set()
    for path in sorted((harness.REPO / "dashboards" / "generated").glob("*.json")):
        dashboard = json.loads(path.read_text())
        for _, expr in [*lint_dashboards.queries(dashboard), *lint_dashboards.variable_selectors(dashboard)]:
            dashboards.update(name for name in lint_dashboards.metric_names(expr) if name.startswith(contract.PREFIX))
    rules = yaml.safe_load((harness.REPO / "alerts" / "kvcache-rules.yml").read_text())["groups"][0]["rules"]
    engines = {series.concept for adapter in adapters.ADAPTERS.values() for series in adapter.series}
    engines |= {name for adapter in adapters.ADAPTERS.values() for name in adapter.not_reported}
    return {
        "exposition": {name for name, _ in samples(exposition_text)},
        "dashboards": dashboards,
        "rules": {name for rule in rules
                  for name in NAME.findall(" ".join([rule["expr"], *rule.get("annotations", {}).values()]))},
        "docs/metrics.md": set(NAME.findall((harness.REPO / "docs" / "metrics.md").read_text())),
        "top": set(top_source.WANTED),
        "self-metrics": {contract.PREFIX + name for name in ExporterState().lines(0, 0)} | {
            contract.FAMILIES[name].metric for name in process_series.lines()},
        "adapters": {contract.PREFIX + name for name in engines},
    }


# Consumers that name families (a histogram by its own name), not the series a query or a scrape reads.
BY_FAMILY = ("docs/metrics.md", "adapters")


def test_every_family_a_consumer_names_is_in_the_table(exposed):
    named = consumers(exposed)
    assert all(len(names) >= 5 for names in named.values()), {k: len(v) for k, v in named.items()}
    assert {where: outside_the_table(names, where in BY_FAMILY) for where, names in named.items()} == \
        dict.fromkeys(named, [])


def test_a_name_outside_the_table_is_caught(exposed):
    """A misspelt family, a histogram read by its bare name, a family nothing defines: each is named."""
    text = exposed + "# TYPE kvcache_usage_ratios gauge\nkvcache_usage_ratios 1.0\n"
    exposition_names = {name for name, _ in samples(text)}
    docs = "`kvcache_queue_time_seconds` and `kvcache_requests_running_cap`"
    assert outside_the_table(exposition_names) == ["kvcache_usage_ratios"]
    assert outside_the_table(NAME.findall(docs), families=True) == ["kvcache_requests_running_cap"]
    query = "rate(kvcache_queue_time_seconds[5m]) / rate(kvcache_queue_time_seconds_count[5m])"
    assert outside_the_table(NAME.findall(query)) == ["kvcache_queue_time_seconds"]


def test_every_family_in_the_table_is_emitted(exposed):
    """No dead family: the fixtures, a stream and the exporter's own series expose each at least once."""
    emitted = {contract.family_of(name).name for name, _ in samples(exposed)}
    assert sorted(set(contract.FAMILIES) - emitted) == []


def test_every_series_carries_its_familys_labels_and_values(exposed):
    seen_values: dict[str, set[str]] = {}
    for name, labels in samples(exposed):
        family = contract.family_of(name)
        own = family.labels + (("le",) if name.endswith("_bucket") else ())
        if "worker" in family.labels and "worker" not in labels:  # the serving process's: empty, left out
            labels = {**labels, "worker": ""}
        static = tuple(STATIC) if family.identity else ()
        assert sorted(labels) == sorted((*family.identity, *static, *own)), name
        for label in (*family.labels, *(label for label in family.identity if label in LABEL_VALUES)):
            seen_values.setdefault(f"{family.name}{{{label}}}" if label == "reason" else label, set()).add(
                labels[label])
    for label, allowed in LABEL_VALUES.items():
        assert seen_values[label] <= allowed, label
    assert seen_values["state"] == LABEL_VALUES["state"]
    # Every role, stage and failure kind is read from some engine's page.
    assert {label: seen_values[label] for label in ("role", "stage", "kind")} == {
        label: LABEL_VALUES[label] for label in ("role", "stage", "kind")}
    for family, reasons in REASONS.items():
        assert seen_values[f"{family}{{reason}}"] == set(reasons), family


def test_every_name_spells_its_unit():
    """Base units in the name: a family's unit is one of its words, and a name ending in a unit declares it."""
    for family in contract.FAMILIES.values():
        words = family.name.removesuffix("_total").split("_")
        assert family.unit in ("", *contract.UNITS) and (not family.unit or family.unit in words), family.name
        assert words[-1] not in contract.UNITS or family.unit == words[-1], family.name
        assert family.name.endswith("_total") == (family.type == "counter"), family.name


def test_tops_columns_all_have_a_source(exposed):
    """Each row value `top` takes from a family is given by some engine's page."""
    frame = top_source.read_frame(exposed, 0.0)
    rows = build_rows(frame, RateWindow())
    from_families = [key for key in rows[0] if key in contract.FAMILIES]
    assert "requests_running_max" in from_families and len(from_families) >= 8
    assert [key for key in from_families if all(row[key] is None for row in rows)] == []
    capped = {row["engine"]: row["requests_running_max"] for row in rows if row["requests_running_max"] is not None}
    assert capped == {"trtllm": 256.0, "triton": 64.0}


def test_the_dashboards_lint_knows_every_family():
    assert {contract.family_of(name).name for name in lint_dashboards.CONTRACT_SERIES} == set(contract.FAMILIES)
    assert lint_dashboards.expression_problems("sum(kvcache_exporter_probe_evictions_total)") == [
        "uses counter kvcache_exporter_probe_evictions_total outside rate()/increase()"]


def test_the_stream_families_render_as_the_polled_ones(exposed):
    """A KV event stream's series come from the exposition's own rendering: one HELP and TYPE per family,
    with the polled targets' series of other families around them."""
    heads = re.findall(r"^# TYPE (\S+) ", exposed, re.MULTILINE)
    assert heads == [family.metric for family in contract.FAMILIES.values() if family.metric in heads]
    assert len(heads) == len(set(heads)) == len(contract.FAMILIES)
    stored = [line for line in exposed.splitlines() if line.startswith("kvcache_events_blocks_stored_total{")]
    assert len(stored) == 1 and stored[0].startswith('kvcache_events_blocks_stored_total{target="architecture",')
    assert stored[0].endswith(',dp_rank="0",role="unified",cluster="test"} 5.0')  # 3 stored, 1 stored again, 1 loaded from the CPU tier
