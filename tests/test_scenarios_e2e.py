"""The exporter's derived series follow the simulator's scenarios, through the real HTTP path."""

from __future__ import annotations

import time

import pytest
import yaml

from simulator.server import start_engine
from tests import harness
from tests.parser_oracle import oracle_samples, our_samples

SPEED = 20.0
# At 20x a poll every 0.25 s reads the engine every 5 simulated seconds: the saturated phase before
# the first preemption lasts a few of those. Sampling /metrics more often than the exporter polls
# catches every poll's outcome.
POLL = 0.25
SAMPLE_EVERY = 0.1
RUNS = {  # target name -> (flavor, scenario)
    "vllm-saturation": ("vllm-v1", "kv-saturation"),
    "sglang-saturation": ("sglang", "kv-saturation"),
    "vllm-cap": ("vllm-v1", "concurrency-cap"),
    "sglang-cap": ("sglang", "concurrency-cap"),
    "vllm-restart": ("vllm-v1", "restart"),
    "sglang-restart": ("sglang", "restart"),
}
WALL_SECONDS = 26.0  # 520 simulated seconds: saturation reaches thrashing, the cap binds, both restart at 180 s


@pytest.fixture(scope="module")
def timeline(tmp_path_factory):
    """Per target, every SAMPLE_EVERY seconds: (pressure state, waiting, preemptions, prompt tokens)."""
    tmp = tmp_path_factory.mktemp("scenarios")
    engines = {name: start_engine(flavor, scenario, speed=SPEED, seed=3) for name, (flavor, scenario) in RUNS.items()}
    try:
        config = tmp / "exporter.yml"
        config.write_text(yaml.safe_dump({"poll_interval": f"{POLL}s", "targets": [
            {"name": name, "url": engine.url} for name, engine in engines.items()]}))
        seen: dict[str, list[tuple]] = {name: [] for name in RUNS}
        with harness.exporter(tmp, "--config", str(config)) as exporter:
            harness.wait_until(lambda: harness.http_get(exporter.url + "/ready")[0] == 200, 15, what="ready")
            deadline = time.monotonic() + WALL_SECONDS
            while time.monotonic() < deadline:
                samples = harness.scrape(exporter.url)
                for name in RUNS:
                    states = harness.series(samples, "kvcache_pressure_state", target=name)
                    current = [dict(k[1])["state"] for k, v in states.items() if v == 1.0]
                    seen[name].append((
                        current[0] if current else None,
                        harness.series(samples, "kvcache_requests_waiting", target=name),
                        harness.series(samples, "kvcache_preemptions_total", target=name),
                        harness.series(samples, "kvcache_prompt_tokens_total", target=name),
                    ))
                time.sleep(SAMPLE_EVERY)
        yield seen
    finally:
        for engine in engines.values():
            engine.stop()


def total(series: dict) -> float:
    return sum(series.values())


@pytest.mark.parametrize("name", ["vllm-saturation", "sglang-saturation"])
def test_kv_saturation_reaches_saturated_then_thrashing(timeline, name):
    states = [state for state, *_ in timeline[name]]
    assert "saturated" in states, states
    first_saturated = states.index("saturated")
    assert "thrashing" in states[first_saturated:], states
    assert max(total(waiting) for _, waiting, _, _ in timeline[name]) >= 10


@pytest.mark.parametrize("name", ["vllm-cap", "sglang-cap"])
def test_concurrency_cap_queues_without_leaving_ok_or_tight(timeline, name):
    states = {state for state, *_ in timeline[name]}
    assert states <= {"ok", "tight"}, states
    assert max(total(waiting) for _, waiting, _, _ in timeline[name]) >= 20  # requests did wait
    assert max(total(preempted) for _, _, preempted, _ in timeline[name]) == 0


@pytest.mark.parametrize("name", ["vllm-restart", "sglang-restart"])
def test_restart_gives_no_negative_value_and_no_preemption_burst(timeline, name):
    prompts = [total(p) for *_, p in timeline[name] if p]
    assert any(b < a for a, b in zip(prompts, prompts[1:])), "the engine never restarted"
    assert "thrashing" not in {state for state, *_ in timeline[name]}
    assert min(min(p.values(), default=0) for *_, p in timeline[name]) >= 0


@pytest.mark.parametrize("flavor", ["vllm-v1", "vllm-v0", "sglang"])
@pytest.mark.parametrize("scenario", ["steady", "kv-saturation", "restart"])
def test_every_simulated_page_parses_like_prometheus_client(flavor, scenario):
    with start_engine(flavor, scenario, speed=50.0, seed=1, tp=2 if flavor == "sglang" else 1) as engine:
        for _ in range(3):
            time.sleep(0.7)
            status, text = harness.http_get(engine.url)
            assert status == 200
            expected = oracle_samples(text)
            assert len(expected) > 50
            assert our_samples(text) == expected
