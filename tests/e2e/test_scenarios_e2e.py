"""The exporter's derived series follow the simulator's scenarios, through the real HTTP path."""

from __future__ import annotations

import time
from typing import NamedTuple

import pytest
import yaml

from kvcache_exporter.simulator.server import start_engine
from devtools import harness
from devtools.harness import oracle_samples, our_samples

SPEED = 20.0
# At 20x a poll every 0.25 s reads the engine every 5 simulated seconds: the saturated phase before
# the first preemption lasts a few of those. Sampling /metrics more often than the exporter polls
# catches every poll's outcome.
POLL = 0.25
SAMPLE_EVERY = 0.1
RUNS = {  # target name -> (flavor, scenario, data-parallel ranks)
    "vllm-saturation": ("vllm-v1", "kv-saturation", 1),
    "sglang-saturation": ("sglang", "kv-saturation", 1),
    "vllm-cap": ("vllm-v1", "concurrency-cap", 1),
    "sglang-cap": ("sglang", "concurrency-cap", 1),
    "vllm-steady-dp2": ("vllm-v1", "steady", 2),  # num_gpu_blocks summed over the engines
    "vllm-steady-dp2-tokens": ("vllm-v1-kv-tokens", "steady", 2),  # + the first engine's kv_cache_size_tokens
    "sglang-steady": ("sglang", "steady", 1),
    "vllm-restart": ("vllm-v1", "restart", 1),
    "sglang-restart": ("sglang", "restart", 1),
    "vllm-wedged": ("vllm-v1", "wedged", 1),  # admits nothing from 240 s (12 s of wall time) on
}
WALL_SECONDS = 26.0  # 520 simulated seconds: saturation reaches thrashing, the cap binds, both restart at 180 s
# Reads of every target at least, however busy the machine (about 200 fit in WALL_SECONDS idle, 5 to 20 were
# seen beside four vLLM engines): the run goes on past WALL_SECONDS until it has them, three times longer at most.
MIN_READS = 40
PER_RANK = {  # Sample field -> contract family, read per dp_rank
    "running": "kvcache_requests_running", "waiting": "kvcache_requests_waiting",
    "for_kv": "kvcache_requests_waiting_for_kv", "with_room": "kvcache_requests_waiting_with_kv_room", "preempted": "kvcache_preemptions_total",
    "prompts": "kvcache_prompt_tokens_total", "capacity_blocks": "kvcache_capacity_blocks",
    "capacity_tokens": "kvcache_capacity_tokens",
}


class Sample(NamedTuple):
    """One read of /metrics for one target: every field maps dp_rank -> value."""
    states: dict
    reasons: dict
    running: dict
    waiting: dict
    for_kv: dict
    with_room: dict
    preempted: dict
    prompts: dict
    capacity_blocks: dict
    capacity_tokens: dict


def per_rank(samples: dict, name: str, target: str) -> dict:
    return {dict(k[1])["dp_rank"]: v for k, v in harness.series(samples, name, target=target).items()}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """Per target, every SAMPLE_EVERY seconds, a Sample; and each engine's published state at the end."""
    tmp = tmp_path_factory.mktemp("scenarios")
    engines = {name: start_engine(flavor, scenario, speed=SPEED, seed=3, dp=dp)
               for name, (flavor, scenario, dp) in RUNS.items()}
    try:
        config = tmp / "exporter.yml"
        config.write_text(yaml.safe_dump({"poll_interval": f"{POLL}s", "targets": [
            {"name": name, "url": engine.url} for name, engine in engines.items()]}))
        seen: dict[str, list[Sample]] = {name: [] for name in RUNS}
        with harness.exporter(tmp, "--config", str(config)) as exporter:
            harness.wait_until(lambda: harness.http_get(exporter.url + "/ready")[0] == 200, 15, what="ready")
            started = time.monotonic()
            while (time.monotonic() - started < WALL_SECONDS
                   or min(map(len, seen.values())) < MIN_READS and time.monotonic() - started < 4 * WALL_SECONDS):
                samples = harness.scrape(exporter.url)
                for name in RUNS:
                    states, reasons = ({dict(k[1])["dp_rank"]: dict(k[1])[label] for k, v in harness.series(
                        samples, f"kvcache_pressure_{label}", target=name).items() if v == 1.0}
                        for label in ("state", "reason"))
                    seen[name].append(Sample(states, reasons, **{field: per_rank(samples, family, name)
                                                        for field, family in PER_RANK.items()}))
                time.sleep(SAMPLE_EVERY)
        yield seen, {name: engine.state() for name, engine in engines.items()}
    finally:
        for engine in engines.values():
            engine.stop()


@pytest.fixture(scope="module")
def timeline(run):
    return run[0]


def total(series: dict) -> float:
    return sum(series.values())


def states_of(timeline, name: str) -> list[str | None]:
    return [sample.states.get("0") for sample in timeline[name]]


@pytest.mark.parametrize("name", ["vllm-saturation", "sglang-saturation"])
def test_kv_saturation_reaches_saturated_then_thrashing(timeline, name):
    states = states_of(timeline, name)
    assert "saturated" in states, states
    first_saturated = states.index("saturated")
    assert "thrashing" in states[first_saturated:], states
    assert max(total(sample.waiting) for sample in timeline[name]) >= 10
    assert "capped" not in states[first_saturated:], states  # the queue behind a full pool is KV's
    # while saturated, the queue waits for KV (SGLang gives no reason: the whole queue)
    saturated = [sample for sample in timeline[name] if sample.states.get("0") == "saturated"]
    assert all(sample.for_kv["0"] > 0 for sample in saturated)
    if name.startswith("sglang"):
        assert all(sample.for_kv["0"] == sample.waiting["0"] for sample in saturated)


@pytest.mark.parametrize("name", ["vllm-cap", "sglang-cap"])
def test_concurrency_cap_reads_capped_and_nothing_waits_for_kv(timeline, name):
    states = {state for sample in timeline[name] for state in sample.states.values()}
    assert "capped" in states and states <= {"ok", "tight", "capped"}, states
    assert max(total(sample.waiting) for sample in timeline[name]) >= 20  # requests did wait
    assert max(total(sample.preempted) for sample in timeline[name]) == 0
    long_queues = [(sample, rank) for sample in timeline[name] for rank, waiting in sample.waiting.items()
                   if waiting >= 20]
    assert long_queues
    for sample, rank in long_queues:
        assert (sample.states[rank], sample.reasons[rank]) == ("capped", "cap")  # the cap's requests run
        assert (sample.for_kv[rank], sample.with_room[rank]) == (0, sample.waiting[rank])


@pytest.mark.parametrize("name", ["vllm-steady-dp2", "vllm-steady-dp2-tokens", "sglang-steady"])
def test_steady_pools_read_ok(timeline, name):
    states = {state for sample in timeline[name] for state in sample.states.values()}
    assert states == {"ok"}
    assert max(total(sample.waiting) for sample in timeline[name]) == 0


@pytest.mark.parametrize("name", RUNS)
def test_the_waiting_split_adds_up_to_the_queue(timeline, name):
    checked = 0
    for sample in timeline[name]:
        for rank, waiting in sample.waiting.items():
            assert rank in sample.for_kv and rank in sample.with_room  # every queue reading comes with its split
            assert sample.for_kv[rank] + sample.with_room[rank] == waiting
            assert sample.for_kv[rank] >= 0 and sample.with_room[rank] >= 0
            checked += 1
    assert checked >= MIN_READS


@pytest.mark.parametrize("name", ["vllm-steady-dp2", "vllm-steady-dp2-tokens"])
def test_data_parallel_vllm_capacity_is_each_engines_own(run, name):
    """vLLM writes num_gpu_blocks summed over its engines into each engine's cache_config_info; every rank's
    capacity must still be its own pool (the simulator's configured blocks), not the deployment's."""
    timeline, states = run
    configs = [rank.config for rank in states[name].ranks]
    assert len(configs) == 2
    last = timeline[name][-1]
    for index, config in enumerate(configs):
        assert last.capacity_blocks[str(index)] == config.num_blocks
        assert last.capacity_tokens[str(index)] == config.num_blocks * config.block_size


def test_wedged_reads_capped_admitting_nothing_beside_a_growing_queue_while_its_counters_stand_still(timeline):
    """Once wedged (a queue no steady pool reaches: the engine serves as steady first, under 10 waiting), the prompt
    counter the exporter mirrors stands still while the queue grows beside a free pool: the pressure state reads
    capped (not KV). Its reason says the engine admits nothing once none runs; while the last requests admitted
    before the wedge still run (outputs reach 1,500 tokens, 30 simulated seconds), the exporter cannot tell the
    wedge from a cap, and the reason reads cap."""
    wedged = [sample for sample in timeline["vllm-wedged"] if total(sample.waiting) >= 30]
    assert len(wedged) >= 20
    assert len({total(sample.prompts) for sample in wedged}) == 1  # nothing admitted
    running = [total(sample.running) for sample in wedged]
    assert running == sorted(running, reverse=True)  # the batch only drains
    # It drains within 2 wall seconds of the 14 the wedge has before the run ends: most of the samples, 10 at least
    # where the machine is slow enough to take only MIN_READS.
    assert len([count for count in running if count == 0]) >= 10
    assert {state for sample in wedged for state in sample.states.values()} == {"capped"}
    assert [sample.reasons["0"] for sample in wedged] == [
        "admits_nothing" if count == 0 else "cap" for count in running]
    queue = [total(sample.waiting) for sample in wedged]
    assert queue == sorted(queue) and queue[-1] >= 100  # 3 arrivals a simulated second, none leaves
    assert all(sample.for_kv["0"] == 0 for sample in wedged)


@pytest.mark.parametrize("name", ["vllm-restart", "sglang-restart"])
def test_restart_gives_no_negative_value_and_no_preemption_burst(timeline, name):
    prompts = [total(sample.prompts) for sample in timeline[name] if sample.prompts]
    assert any(b < a for a, b in zip(prompts, prompts[1:])), "the engine never restarted"
    assert "thrashing" not in states_of(timeline, name)
    assert min(min(sample.prompts.values(), default=0) for sample in timeline[name]) >= 0


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
