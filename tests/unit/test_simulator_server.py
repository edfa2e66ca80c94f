"""The simulator's HTTP path, in this process: real sockets on loopback, real scrapes.
tests/e2e/test_simulator_cli.py runs its command line."""

from __future__ import annotations

import re
import threading
import time

import pytest
import requests
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics
from prometheus_client.parser import text_string_to_metric_families

from kvcache_exporter.simulator import start_engine
from kvcache_exporter.simulator.workload import Workload
from kvcache_exporter.simulator.scenarios import Phase, Scenario, ScenarioError

TIMEOUT_S = 30  # generous: the machine is shared; nothing here asserts speed


def wait_for(condition, what: str):
    deadline = time.monotonic() + TIMEOUT_S
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def scrape(url: str, **headers) -> dict[str, list]:
    response = requests.get(url, headers=headers, timeout=10)
    assert response.status_code == 200
    samples: dict[str, list] = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append(sample)
    return samples


@pytest.mark.parametrize("flavor,usage_name", [
    ("vllm-v1", "vllm:kv_cache_usage_perc"),
    ("vllm-v0", "vllm:gpu_cache_usage_perc"),
    ("sglang", "sglang:token_usage"),
])
def test_an_engine_serves_its_flavor_over_http(flavor, usage_name):
    with start_engine(flavor, "kv-saturation", port=0, speed=50, seed=1, model="m", tp=2) as engine:
        assert re.fullmatch(rf"http://127\.0\.0\.1:{engine.port}/metrics", engine.url) and engine.port > 0
        wait_for(lambda: engine.sim_time >= 20, "20 simulated seconds")
        response = requests.get(engine.url, timeout=10)
        assert response.headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
        samples = scrape(engine.url)
        usage = samples[usage_name]
        assert len(usage) == (2 if flavor == "sglang" else 1)  # SGLang repeats per TP rank
        assert all(0 < s.value <= 1 and s.labels["model_name"] == "m" for s in usage)
        assert ("vllm:prompt_tokens_created" in samples) == (flavor == "vllm-v1")

        base = engine.url.removesuffix("/metrics")
        assert requests.get(base + "/health", timeout=10).status_code == 200
        assert requests.get(base + "/v1/models", timeout=10).status_code == 404

        openmetrics = requests.get(engine.url, headers={"Accept": "application/openmetrics-text; version=1.0.0"},
                                   timeout=10)
        assert openmetrics.headers["Content-Type"].startswith("application/openmetrics-text")
        assert openmetrics.text.endswith("# EOF\n")
        names = {family.name for family in parse_openmetrics(openmetrics.text)}
        assert usage_name in names  # colons survive OpenMetrics too

        zipped = requests.get(engine.url, headers={"Accept-Encoding": "gzip"}, timeout=10)
        assert zipped.headers["Content-Encoding"] == "gzip" and usage_name in zipped.text


def test_two_engines_run_side_by_side_and_scrapes_do_not_stop_the_model():
    with start_engine("vllm-v1", "steady", speed=30) as vllm, start_engine("sglang", "steady", speed=30) as sglang:
        assert vllm.port != sglang.port
        errors = []

        def hammer(url):
            try:
                for _ in range(20):
                    scrape(url)
            except Exception as exc:  # reported below: a failed scrape must fail the test
                errors.append(exc)

        threads = [threading.Thread(target=hammer, args=(url,)) for url in (vllm.url, sglang.url) * 2]
        for thread in threads:
            thread.start()
        start = vllm.sim_time
        wait_for(lambda: vllm.sim_time > start + 5 and sglang.sim_time > 5, "both models advancing during scrapes")
        for thread in threads:
            thread.join()
        assert not errors
        assert "vllm:num_requests_running" in scrape(vllm.url) and "sglang:num_running_reqs" not in scrape(vllm.url)
        assert "sglang:num_running_reqs" in scrape(sglang.url)


def test_a_restart_resets_the_counters_and_moves_created():
    # Busy for 100 s, then a restart into silence: after it every counter stays at zero.
    busy = Workload(arrival_rate=5.0)
    scenario = Scenario(name="restart-into-silence", then="hold", phases=(
        Phase("busy", 100, busy), Phase("silent", 1, Workload(arrival_rate=0.0), restart=True)))
    speed = 50
    with start_engine("vllm-v1", scenario, speed=speed) as engine:
        wait_for(lambda: engine.state().ranks[0].counters.prompt_tokens > 0, "traffic")
        before = scrape(engine.url)
        wait_for(lambda: engine.restarts == 1, "the restart")
        after = scrape(engine.url)
    assert before["vllm:prompt_tokens_total"][0].value > 0
    assert after["vllm:prompt_tokens_total"][0].value == 0
    assert after["vllm:e2e_request_latency_seconds_count"][0].value == 0
    created_before = before["vllm:prompt_tokens_created"][0].value
    created_after = after["vllm:prompt_tokens_created"][0].value
    assert created_after - created_before == pytest.approx(100 / speed)


def test_the_states_scrapes_rendered_are_kept_with_when_each_was_read():
    with start_engine("vllm-v1", "kv-saturation", speed=50, served_history=2) as engine:
        wait_for(lambda: engine.state().ranks[0].counters.prompt_tokens > 0, "traffic")
        pages = []
        for _ in range(3):
            before = time.time()
            pages.append((before, scrape(engine.url), time.time()))
        served = engine.served()
    assert len(served) == 2  # the last two
    for (before, page, after), (read, state) in zip(pages[1:], served):
        assert before <= read <= after
        counters = state.ranks[0].counters
        assert page["vllm:prompt_tokens_total"][0].value == counters.prompt_tokens > 0
        assert page["vllm:num_preemptions_total"][0].value == counters.preemptions_rescheduled


def test_start_engine_rejects_bad_arguments():
    with pytest.raises(ValueError, match="unknown flavor 'tgi'"):
        start_engine("tgi")
    with pytest.raises(ValueError, match="supports dp <= 1"):
        start_engine("vllm-v0", dp=2)
    with pytest.raises(ValueError, match="speed must be > 0"):
        start_engine("sglang", speed=0)
    with pytest.raises(ScenarioError, match="engine.max_num_seqs"):
        start_engine("sglang", max_num_seqs="many")
