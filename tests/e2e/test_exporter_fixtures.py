"""The exporter, run against a local server replaying each fixture page, exposes the expected numbers: as
one process, and with two worker processes polling the targets between them (`workers: 2`)."""

from __future__ import annotations

import math
import re
import subprocess

import pytest
import yaml

from kvcache_exporter import contract
from devtools import harness
from devtools import kvevents_wire as wire
from devtools.harness import Publisher
from devtools.harness import PageServer, page

FIXTURES = harness.FIXTURES
EXPECTED = {p.name.removesuffix(".expected.yml"): yaml.safe_load(p.read_text())
            for p in sorted(FIXTURES.glob("*.txt.expected.yml"))}
ROOT = harness.REPO
CONTRACT = ROOT / "docs" / "metrics.md"
README = ROOT / "README.md"
HISTOGRAM_PARTS = ("_count", "_sum")


def content_type(text: str) -> str:
    if text.rstrip().endswith("# EOF"):
        return "application/openmetrics-text; version=1.0.0; charset=utf-8"
    return "text/plain; version=0.0.4; charset=utf-8"


@pytest.fixture(scope="module", params=[1, 2], ids=["one-process", "two-workers"])
def exposition(request, tmp_path_factory):
    """One exporter polling every fixture page (plus one with a model architecture); its /metrics text."""
    tmp = tmp_path_factory.mktemp("fixtures")
    routes = {f"/{name}": page((FIXTURES / name).read_text(), content_type=content_type((FIXTURES / name).read_text()))
              for name in EXPECTED}
    events_port = harness.free_port()
    with PageServer(routes) as server, Publisher(events_port) as publisher:
        # A page that names no role gets the one its expectations configure (`target_config:`).
        targets = [{"name": name, "url": server.url(f"/{name}"), **EXPECTED[name].get("target_config", {})}
                   for name in EXPECTED]
        # ... with a KV event stream too: its families appear once a batch has arrived
        targets.append({"name": "with-architecture", "url": server.url("/vllm-v1.txt"),
                        "labels": {"pool": "chat"},
                        "model_architecture": {"layers": 32, "kv_heads": 8, "head_dim": 128},
                        "kv_events": {"endpoint": f"tcp://127.0.0.1:{events_port}"}})
        config = tmp / "exporter.yml"
        settings = {"poll_interval": "2s", "labels": {"cluster": "test"}, "targets": targets, "workers": request.param}
        if request.param == 1:  # the fleet index takes one process (a configuration with workers refuses it)
            settings["fleet_index"] = {"enabled": True}
        config.write_text(yaml.safe_dump(settings))
        with harness.exporter(tmp, "--config", str(config)) as exporter:
            # every target answered once (on a busy machine a first poll may time out and be retried)
            harness.wait_until(lambda: all(v == 1.0 for v in harness.series(
                harness.scrape(exporter.url), "kvcache_target_up").values()), 30, what="every target up")
            # One stored block of an adapter and a tenant, and one a CPU tier holds, so that every event family
            # has a series.
            stored = [wire.stored("vllm-map", [1], salt="tenant-a", lora_name="sql"),
                      wire.stored("vllm-map", [2], medium="CPU")]
            harness.wait_until(lambda: (publisher.send(wire.batch("vllm-map", 1.0, stored)), harness.series(
                harness.scrape(exporter.url), "kvcache_tier_blocks_resident"))[1], 30,
                what="a KV event batch received")
            status, text = harness.http_get(exporter.url + "/metrics")
            assert status == 200
            workers = harness.children(exporter.proc.pid)
            assert len(workers) == (request.param if request.param > 1 else 0)
            assert f"kvcache_exporter_workers {request.param}.0\n" in text
            yield text


@pytest.fixture(scope="module")
def samples(exposition):
    from prometheus_client.parser import text_string_to_metric_families

    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(exposition) for s in family.samples}


def test_the_corpus_covers_every_engine():
    from kvcache_exporter.adapters import ADAPTERS

    assert {e["engine"] for e in EXPECTED.values()} == set(ADAPTERS)
    assert len(EXPECTED) >= 18


@pytest.mark.parametrize("name", EXPECTED)
def test_fixture_values(samples, name):
    expected = EXPECTED[name]
    assert harness.value(samples, "kvcache_target_up", target=name) == 1.0
    assert harness.value(samples, "kvcache_target_info", target=name, engine=expected["engine"]) == 1.0
    for rank, values in expected["ranks"].items():
        labels = {"target": name, "dp_rank": rank, "engine": expected["engine"], "model": expected["model"],
                  "role": expected["role"], "cluster": "test"}
        for key, want in values.items():
            if key in ("pressure_state", "pressure_reason"):  # a state set: the expected one is at 1
                label = key.removeprefix("pressure_")
                assert harness.value(samples, "kvcache_" + key, **{label: want}, **labels) == 1.0, (name, rank)
                continue
            family, _, label_part = key.partition("{")  # `tier_used_tokens{tier=cpu}`: a labelled family
            extra = dict(pair.split("=") for pair in label_part.rstrip("}").split(",")) if label_part else {}
            got = harness.value(samples, "kvcache_" + family, **labels, **extra)
            assert math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-6), f"{name} dp_rank={rank} {key}: {got} != {want}"
    # Pages without a usage reading (request-only TensorRT-LLM, a Dynamo frontend) still have per-pool series.
    exposed_ranks = {dict(labels)["dp_rank"] for (metric, labels) in samples
                     if metric.startswith("kvcache_") and dict(labels).get("target") == name and "dp_rank" in dict(labels)}
    assert exposed_ranks == set(expected["ranks"])
    for key in expected.get("absent") or ():
        names = [f"kvcache_{key}{part}" for part in HISTOGRAM_PARTS] if "seconds" in key else [f"kvcache_{key}"]
        for metric in names:
            assert harness.series(samples, metric, target=name) == {}, f"{name}: {metric} must be absent"


def test_pressure_state_is_one_hot(samples):
    for name in EXPECTED:
        if "pressure_state" in (EXPECTED[name].get("absent") or ()):
            continue
        for rank in EXPECTED[name]["ranks"]:
            states = harness.series(samples, "kvcache_pressure_state", target=name, dp_rank=rank)
            assert sorted(dict(k[1])["state"] for k in states) == sorted(contract.PRESSURE_STATES)
            assert sum(states.values()) == 1.0


def test_bytes_series_follow_the_architecture(samples):
    labels = {"target": "with-architecture", "dp_rank": "0", "pool": "chat"}
    tokens = harness.value(samples, "kvcache_capacity_tokens", **labels)
    assert harness.value(samples, "kvcache_bytes_per_token", **labels) == 131072
    assert harness.value(samples, "kvcache_capacity_bytes", **labels) == tokens * 131072
    used = harness.value(samples, "kvcache_used_tokens", **labels)
    assert harness.value(samples, "kvcache_used_bytes", **labels) == used * 131072
    assert harness.series(samples, "kvcache_bytes_per_token", target="vllm-v1.txt") == {}


def test_promtool_check_metrics_is_silent(exposition):
    result = subprocess.run([harness.require_binary("promtool"), "check", "metrics"], input=exposition,
                            capture_output=True, text=True, timeout=60)
    assert (result.returncode, result.stdout + result.stderr) == (0, "")


def contract_families() -> set[str]:
    return set(re.findall(r"`(kvcache_[a-z0-9_]+)", CONTRACT.read_text()))


def test_every_contract_family_is_exposed(exposition):
    families = contract_families()
    assert len(families) >= 30
    if "kvcache_exporter_workers 1.0\n" not in exposition:  # workers: no fleet index (refused with workers)
        families -= {"kvcache_" + name for name, family in contract.FAMILIES.items() if family.group == "fleet"}
    exposed = set(re.findall(r"^# TYPE (kvcache_[a-z0-9_]+) ", exposition, re.MULTILINE))
    # prometheus_client names counter families without `_total` in the TYPE line.
    exposed |= {name + "_total" for name in exposed}
    assert sorted(families - exposed) == []


def test_the_readme_links_the_contract():
    assert "(docs/metrics.md)" in README.read_text()
