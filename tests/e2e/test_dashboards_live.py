"""Every query of both dashboards against Debian's Prometheus after it scraped the exporter in
front of a simulated vLLM (running out of KV) and a simulated SGLang engine (steady traffic), both
with a CPU offload tier.

The stack starts once per module. A query passes when Prometheus accepts it (instant and
range) and the range result holds at least one number that is not NaN. The few queries that
cannot return data in a short run are listed in NO_DATA_EXPECTED with the reason, and the test
checks that they indeed return none, so the list cannot go stale.
"""

from __future__ import annotations

import json
import math
import re
import time
import urllib.parse

import pytest
import yaml

from kvcache_exporter.dashboards import build, fleet, target
from devtools import lint_dashboards as lint
from kvcache_exporter.contract import PRESSURE_STATES
from kvcache_exporter.simulator.pd import BUILTIN_PD_SCENARIOS, parse_pd_scenario, start_pd_pair
from kvcache_exporter.simulator.server import start_engine
from devtools import harness

RUN_SECONDS = 60  # at speed 20, kv-saturation queues for KV within ~20 s and preempts within ~40 s
RATE_INTERVAL = "15s"
STEP_SECONDS = 5
MATCH_ALL = ".*"

# (dashboard file, panel title or annotation name) -> why that query has no data here.
ANNOTATION = "Anno"  # a dashboard annotation's query in place of a panel's refId
NO_DATA_EXPECTED = {
    (fleet.FILENAME, "Hit ratio vs baseline"): "compares with the ratio 1h earlier; the run is 60 s old",
    (target.FILENAME, "Hit ratio vs baseline"): "compares with the ratio 1h earlier; the run is 60 s old",
    (fleet.FILENAME, "Firing KV-cache alerts"): "no alert rules are loaded (the dashboards must not need them)",
    (target.FILENAME, "Firing KV-cache alerts"): "no alert rules are loaded (the dashboards must not need them)",
}


# A disaggregated SGLang pair whose transfers read faster than the 50 GB/s link (no latency, 200 GB/s): the
# bandwidth panel's broken-reading line.
TOO_FAST = parse_pd_scenario({**BUILTIN_PD_SCENARIOS["pd-steady"], "link": {"latency_s": 0, "bytes_per_s": 2e11}},
                             "too-fast", "too-fast")


def pd_targets(vllm_pair, sglang_pair) -> list[dict]:
    """A vLLM pair whose decode side runs short of KV (its roles from the configuration), and the SGLang pair."""
    return [{"name": "vllm-prefill", "url": vllm_pair.prefill_url, "engine": "vllm", "role": "prefill"},
            {"name": "vllm-decode", "url": vllm_pair.decode_url, "engine": "vllm", "role": "decode"},
            {"name": "sglang-prefill", "url": sglang_pair.prefill_url, "engine": "sglang"},
            {"name": "sglang-decode", "url": sglang_pair.decode_url, "engine": "sglang"}]


def exporter_config(vllm_url: str, sglang_url: str, trtllm_url: str, dead_url: str, events: tuple[str, str],
                    disaggregated: list[dict]) -> dict:
    architecture = {"layers": 32, "kv_heads": 8, "head_dim": 128, "model_dtype": "bfloat16"}
    return {
        "poll_interval": "0.5s",
        "labels": {"cluster": "test"},
        "fleet_index": {"enabled": True},  # the routing panels' series (one model's two streams)
        "targets": [
            {"name": "vllm-0", "url": vllm_url, "engine": "vllm", "labels": {"pool": "chat"},
             "model_architecture": architecture, "kv_events": {"endpoint": events[0]}},
            {"name": "sglang-0", "url": sglang_url, "engine": "sglang", "labels": {"pool": "batch"},
             "model_architecture": architecture, "kv_events": {"endpoint": events[1]}},
            # TensorRT-LLM: the one engine that reports paused requests.
            {"name": "trtllm-0", "url": trtllm_url, "engine": "trtllm", "labels": {"pool": "chat"}},
            # Nothing listens here: its polls fail, which the exporter-health panels must show.
            {"name": "gone-0", "url": dead_url, "engine": "vllm", "labels": {"pool": "batch"}},
            *disaggregated,
        ],
    }


@pytest.fixture(scope="module")
def prometheus_url(tmp_path_factory):
    work = tmp_path_factory.mktemp("dashboards-live")
    events = tuple(f"tcp://127.0.0.1:{harness.free_port()}" for _ in range(2))
    # vLLM and SGLang with a CPU offload tier, so that the offload panels have their inputs (vLLM's in
    # bytes, SGLang's in tokens); TensorRT-LLM, the one engine that reports paused requests.
    with start_engine("vllm-v1", scenario="kv-saturation", speed=20, seed=1, kv_events_endpoint=events[0],
                      offload_blocks=4096) as vllm, \
            start_engine("sglang", scenario="steady", speed=20, seed=2, kv_events_endpoint=events[1],
                         offload_blocks=4096) as sglang, \
            start_engine("trtllm", scenario="steady", speed=20, seed=3) as trtllm, \
            start_pd_pair("vllm", "pd-decode-short", speed=20, seed=4, model="pd-vllm") as vllm_pair, \
            start_pd_pair("sglang", TOO_FAST, speed=20, seed=5, model="pd-sglang") as sglang_pair:
        config_path = work / "exporter.yml"
        dead_url = f"http://127.0.0.1:{harness.free_port()}/metrics"
        config_path.write_text(yaml.safe_dump(exporter_config(vllm.url, sglang.url, trtllm.url, dead_url, events,
                                                              pd_targets(vllm_pair, sglang_pair))))
        with harness.exporter(work, "--config", str(config_path)) as exporter:
            scrape = {
                "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                "scrape_configs": [{"job_name": "kvcache-exporter",
                                    "static_configs": [{"targets": [exporter.url.removeprefix("http://")]}]}],
            }
            with harness.prometheus(work / "prometheus", scrape) as prometheus:
                harness.wait_until(lambda: harness.prom_vector(prometheus.url, "kvcache_target_up"), 30,
                                   what="Prometheus to scrape the exporter")
                time.sleep(RUN_SECONDS)
                # The run's point is a pool that ran out of KV: make sure Prometheus saw the preemptions.
                harness.wait_until(
                    lambda: harness.prom_vector(prometheus.url, 'kvcache_preemptions_total{target="vllm-0"} > 0'),
                    60, interval=1.0, what="the simulated vLLM to preempt")
                yield prometheus.url


def substitute(expr: str, variables: list[str]) -> str:
    """What Grafana sends for the dashboard with every multi-value filter at All."""
    expr = expr.replace("$__rate_interval", RATE_INTERVAL)
    for name in variables:
        expr = re.sub(rf"\${name}\b", MATCH_ALL, expr)
    assert "$" not in expr, f"unsubstituted variable in {expr}"
    return expr


def numbers(result: list[dict]) -> list[float]:
    values = [float(v) for series in result for _, v in series.get("values", [])]
    return [v for v in values if not math.isnan(v)]


def dashboard_queries(name: str):
    dashboard = json.loads((build.GENERATED / name).read_text())
    filters = [v["name"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    for panel in lint.panels(dashboard):
        for query in panel["targets"]:
            yield panel["title"], query["refId"], substitute(query["expr"], filters)
    for annotation in dashboard["annotations"]["list"]:
        yield annotation["name"], ANNOTATION, substitute(annotation["target"]["expr"], filters)


@pytest.mark.parametrize("name", (fleet.FILENAME, target.FILENAME))
def test_every_query_runs_and_returns_data(prometheus_url, name):
    end = time.time()
    start = end - RUN_SECONDS
    without_data, unexpected_data, checked = [], [], 0
    for title, ref_id, expr in dashboard_queries(name):
        harness.prom_query(prometheus_url, expr, time=end)  # raises on a query error
        result = harness.prom_query(prometheus_url, expr, "/api/v1/query_range",
                                    start=start, end=end, step=STEP_SECONDS)["result"]
        checked += 1
        has_data = bool(numbers(result))
        # Annotations draw firing alerts from ALERTS, as the alerts panel does: empty here for the same reason.
        expected_empty = (name, title) in NO_DATA_EXPECTED or ref_id == ANNOTATION
        if not has_data and not expected_empty:
            without_data.append(f"{title} [{ref_id}]: {expr}")
        if has_data and expected_empty:
            unexpected_data.append(f"{title} [{ref_id}] has data; drop it from NO_DATA_EXPECTED")
    assert checked >= 35
    assert without_data == [], "queries without data:\n" + "\n".join(without_data)
    assert unexpected_data == []


@pytest.mark.parametrize("name", (fleet.FILENAME, target.FILENAME))
def test_every_variable_lists_values(prometheus_url, name):
    dashboard = json.loads((build.GENERATED / name).read_text())
    filters = [v["name"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    listed = {}
    for variable in dashboard["templating"]["list"]:
        if variable["type"] != "query":
            continue
        match = re.fullmatch(r"label_values\((?P<selector>.*), (?P<label>\w+)\)", variable["query"])
        selector = substitute(match.group("selector"), filters)
        status, body = harness.http_get(f"{prometheus_url}/api/v1/label/{match.group('label')}/values?"
                                        + urllib.parse.urlencode({"match[]": selector}))
        assert status == 200, body
        listed[variable["name"]] = sorted(json.loads(body)["data"])
    assert listed["cluster"] == ["test"]
    assert listed["pool"] == ["batch", "chat"]
    assert listed["target"] == ["gone-0", "sglang-0", "sglang-decode", "sglang-prefill", "trtllm-0", "vllm-0",
                                "vllm-decode", "vllm-prefill"]
    if name == fleet.FILENAME:
        assert listed["engine"] == ["sglang", "trtllm", "vllm"]
        assert listed["model"], "no model values"
    # Kubernetes discovery's labels exist only in probe mode on Kubernetes: here nothing is listed, and All keeps
    # every series (the queries above had data with them at All).
    assert listed["namespace"] == [] and listed.get("pod", []) == []


def test_panels_show_the_saturation_and_the_dead_target(prometheus_url):
    """A few numbers the run must produce, so 'returns data' means the right data."""
    exprs = {(title, ref): expr for title, ref, expr in dashboard_queries(fleet.FILENAME)}

    def peak(title: str, ref: str = "A") -> dict[str, float]:
        end = time.time()
        data = harness.prom_query(prometheus_url, exprs[(title, ref)], "/api/v1/query_range",
                                  start=end - RUN_SECONDS, end=end, step=STEP_SECONDS)["result"]
        peaks: dict[str, float] = {}
        for series in data:  # the highest value per target, over the run and over other labels (reason)
            name = series["metric"].get("target", "")
            peaks[name] = max([peaks.get(name, -math.inf), *numbers([series])])
        return peaks

    assert peak("Targets up", "B")[""] == 1  # gone-0 is down
    assert peak("Targets up", "A")[""] == 7
    assert peak("KV usage per target")["vllm-0"] >= 0.9  # kv-saturation fills the pool
    assert peak("Pressure state over time")["vllm-0"] >= PRESSURE_STATES.index("saturated")  # or thrashing
    assert peak("Waiting requests by cause per target", "A")["vllm-0"] >= 1  # waiting for KV
    assert peak("Preemption rate per target")["vllm-0"] > 0
    assert peak("Poll failures by reason")["gone-0"] > 0
    # Disaggregated: the vLLM pair's decode side runs short of KV; the SGLang pair's transfers read too fast.
    assert peak("P/D backpressure")[""] >= 1
    # ... while its prefill side holds what the decode side has not pulled (pd-decode-short: dozens of prompts).
    assert peak("Prefill KV held for export per target")["vllm-prefill"] >= 10_000
    assert peak("Transfer bandwidth per target", "B")["sglang-prefill"] > 5e10  # flagged above the link
    assert "sglang-prefill" not in peak("Transfer bandwidth per target", "A")  # and not believed
    # each of its transfers timed at ~186 GiB/s, above the engine's 50 GiB/s bound: counted, ~3 a second
    assert peak("Transfer failures and lease expiries per target", "D")["sglang-prefill"] > 1
