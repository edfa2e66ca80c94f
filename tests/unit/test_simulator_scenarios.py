"""Built-in scenarios behave as documented (in simulated time), and scenario files load or fail cleanly."""

from __future__ import annotations

import textwrap

import pytest

from kvcache_exporter.simulator.exposition import FLAVORS
from kvcache_exporter.simulator.model import KV_BOUND
from kvcache_exporter.simulator.workload import LengthDist
from kvcache_exporter.simulator.scenarios import ScenarioError, ScenarioRun, load_scenario, override_engine

# The lead's end-to-end tests run kv-saturation at --speed 20 and poll every 0.5-1 s.
SPEED = 20


def usage(model) -> float:
    return model.pool.used / model.config.num_blocks


def sample_every_second(scenario: str, seed: int, flavor: str = "vllm-v1", until: float | None = None):
    """(t, run) after each simulated second; `run` is live, so read what you need right away."""
    sc = load_scenario(scenario)
    run = ScenarioRun(sc, FLAVORS[flavor].reporting, seed=seed)
    for t in range(1, int(until or sc.cycle_s) + 1):
        run.advance_to(t)
        yield t, run


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_kv_saturation_queues_for_kv_then_preempts_then_recovers(seed):
    saturated_at = preempting_at = None
    saturated_samples = overload_samples = 0
    recovery_usage = []
    ttft_mean = {}
    previous = (0, 0.0)
    for t, run in sample_every_second("kv-saturation", seed):
        model = run.models[0]
        waits_for_kv = bool(model.waiting) and model.waiting_reason in KV_BOUND
        if saturated_at is None and usage(model) >= 0.9 and waits_for_kv:
            saturated_at = t
        if preempting_at is None and model.counters.preemptions:
            preempting_at = t
        if 200 <= t < 600:  # the overload phase, once settled
            overload_samples += 1
            saturated_samples += waits_for_kv and usage(model) >= 0.85
        if t in (100, 300, 600):  # TTFT mean of the requests served in the last 100 s
            ttft = model.histograms["ttft"]
            ttft_mean[t] = (ttft.sum - previous[1]) / (ttft.count - previous[0])
            previous = (ttft.count, ttft.sum)
        if t == 800:
            preemptions_at_800 = model.counters.preemptions
        if t > 790:
            recovery_usage.append(usage(model))
    # The queue for KV comes first, preemptions later, both well inside the lead's polling budget.
    assert saturated_at is not None and preempting_at is not None
    assert saturated_at < preempting_at
    assert saturated_at / SPEED <= 10 and preempting_at / SPEED <= 15
    # ... and the state lasts: requests keep waiting for KV through the overload.
    assert saturated_samples >= 0.95 * overload_samples
    assert model.counters.preemptions > 300
    assert ttft_mean[100] < 1
    assert 2 < ttft_mean[300] < 0.5 * ttft_mean[600]
    # Recovery: by the end of the cycle nothing waits, usage is down, preemptions have stopped.
    assert t == 850 and not model.waiting
    assert sum(recovery_usage) / len(recovery_usage) < 0.35
    assert model.counters.preemptions == preemptions_at_800


def test_concurrency_cap_binds_while_kv_stays_under_half_full():
    capped_samples = 0
    for t, run in sample_every_second("concurrency-cap", seed=0):
        model = run.models[0]
        assert usage(model) < 0.5
        assert model.counters.preemptions == 0
        if 100 <= t < 420:
            # A request that just finished leaves a seat that the queue head takes next step.
            assert model.config.max_num_seqs - 1 <= len(model.running) <= model.config.max_num_seqs == 8
            assert model.waiting and model.waiting_reason == "cap"
            capped_samples += len(model.running) == 8
        waiting_at_end = len(model.waiting)
    assert capped_samples >= 0.8 * 320
    assert waiting_at_end == 0  # drained before the scenario repeats


@pytest.mark.parametrize("flavor", ["vllm-v1", "sglang"])
def test_prefix_collapse_halves_the_windowed_hit_ratio(flavor):
    sc = load_scenario("prefix-collapse")
    run = ScenarioRun(sc, FLAVORS[flavor].reporting, seed=4)

    def hit_ratios(start: float, end: float) -> tuple[float, float]:
        """(vLLM admission-time ratio, SGLang finish-time ratio) over [start, end]."""
        run.advance_to(start)
        before = run.models[0].counters
        q0, h0, p0, c0 = (before.prefix_queried_tokens, before.prefix_hit_tokens,
                          before.finished_prompt_tokens, before.finished_cached_tokens)
        run.advance_to(end)
        after = run.models[0].counters
        return ((after.prefix_hit_tokens - h0) / (after.prefix_queried_tokens - q0),
                (after.finished_cached_tokens - c0) / (after.finished_prompt_tokens - p0))

    shared = hit_ratios(120, 300)
    collapsed = hit_ratios(420, 600)
    for before, after in zip(shared, collapsed):
        assert before > 0.4
        assert after < 0.5 * before


def test_steady_stays_clear_of_pressure():
    for _, run in sample_every_second("steady", seed=7):
        model = run.models[0]
        assert usage(model) < 0.9
        assert model.counters.preemptions == 0
        assert len(model.waiting) < 10


def test_restart_resets_counters_and_the_engine_start():
    sc = load_scenario("restart")
    run = ScenarioRun(sc, FLAVORS["vllm-v1"].reporting, seed=0)
    run.advance_to(179.9)
    before = run.models[0]
    assert before.counters.finished_requests > 300 and before.started_at == 0
    run.advance_to(180.5)
    after = run.models[0]
    assert run.generation == 1 and after is not before
    assert after.started_at == 180
    assert after.counters.finished_requests == 0
    assert after.counters.prompt_tokens < 0.05 * before.counters.prompt_tokens
    assert after.histograms["e2e"].count == 0
    run.advance_to(359)
    assert after.counters.finished_requests > 300  # the traffic goes on after the restart


@pytest.mark.parametrize("flavor", ["vllm-v1", "sglang"])
def test_wedged_admits_and_generates_nothing_for_good(flavor):
    """From 240 s the scheduler admits nothing: the running batch runs out within seconds, then no prompt is
    processed and no token generated while 3 requests a second queue beside a pool with nothing in use, for good."""
    seen = {}
    for t, run in sample_every_second("wedged", seed=4, flavor=flavor, until=900):
        model = run.models[0]
        seen[t] = (model.counters.prompt_tokens, model.counters.generation_tokens, len(model.waiting),
                   len(model.running), usage(model), model.report.waiting, model.waiting_reason)
    assert seen[239][1] > 0 and seen[239][2] < 10  # serving as steady
    still = seen[260][:2]
    for t in range(260, 901):
        assert seen[t][:2] == still, t  # nothing admitted, nothing generated
        assert seen[t][3] == 0 and seen[t][4] == 0, t  # nothing runs; only evictable blocks are left
    # The queue grows at the arrival rate (3/s: ~1900 over 640 s), and the page shows it (within a 30 s report).
    assert 1600 < seen[900][2] < 2200
    assert seen[900][5] >= seen[870][2] and seen[900][6] == "wedged"
    assert run.generation == 0


def test_engine_overrides_are_validated_like_a_file():
    sc = override_engine(load_scenario("steady"), {"num_blocks": 4096, "max_num_seqs": 16})
    assert (sc.engine.num_blocks, sc.engine.max_num_seqs, sc.engine.block_size) == (4096, 16, 16)
    with pytest.raises(ScenarioError, match=r"engine overrides: engine\.num_blok: unknown key"):
        override_engine(sc, {"num_blok": 1})
    with pytest.raises(ScenarioError, match=r"engine\.max_num_seqs: must be >= 1"):
        override_engine(sc, {"max_num_seqs": 0})


# -- scenario files -----------------------------------------------------------------------------

def write(tmp_path, text: str):
    path = tmp_path / "scenario.yml"
    path.write_text(textwrap.dedent(text))
    return str(path)


def test_a_scenario_file_scripts_phases_ramps_restarts_and_holds(tmp_path):
    path = write(tmp_path, """
        name: scripted
        then: hold
        engine: {num_blocks: 512, block_size: 32, max_num_seqs: 4}
        phases:
          - name: quiet
            duration_s: 10
            arrival_rate: 1
            prompt_len: 100
            output_len: {dist: uniform, min: 5, max: 10}
            prefix_share: 0
          - name: ramp
            duration_s: 20
            arrival_rate_end: 9
          - name: again
            duration_s: 5
            restart: true
            prompt_len: {dist: lognormal, median: 50, sigma: 0.2, min: 10, max: 80}
        """)
    sc = load_scenario(path)
    assert sc.name == "scripted" and sc.then == "hold" and sc.cycle_s == 35
    assert (sc.engine.num_blocks, sc.engine.block_size, sc.engine.max_num_seqs) == (512, 32, 4)
    quiet, ramp, again = sc.phases
    assert quiet.workload.prompt_len == LengthDist(kind="uniform", low=100, high=100)
    assert ramp.workload.prompt_len == quiet.workload.prompt_len  # inherited
    assert (ramp.workload.arrival_rate, ramp.arrival_rate_end, again.arrival_rate_end) == (1, 9, None)
    assert again.restart and not ramp.restart
    assert again.workload.prompt_len == LengthDist(kind="lognormal", median=50, sigma=0.2, low=10, high=80)

    run = ScenarioRun(sc, FLAVORS["sglang"].reporting, seed=0)
    run.advance_to(20)
    assert run.phase.name == "ramp" and run.arrivals.workload.arrival_rate == pytest.approx(5, abs=0.3)
    run.advance_to(1000)
    assert run.generation == 1  # held in the last phase: no second restart
    assert run.phase.name == "again" and run.arrivals.workload.arrival_rate == 9


@pytest.mark.parametrize("text,expected", [
    ("phases: []", r"phases: must be a non-empty list"),
    ("- 1", r"top level: must be a mapping"),
    ("phases: [{duration_s: 5, arival_rate: 3}]", r"phases\[0\]\.arival_rate: unknown key"),
    ("phases: [{arrival_rate: 3}]", r"phases\[0\]\.duration_s: is required"),
    ("phases: [{duration_s: 0}]", r"phases\[0\]\.duration_s: must be > 0"),
    ("phases: [{duration_s: 5}, {duration_s: 5, arrival_rate: -1}]", r"phases\[1\]\.arrival_rate: must be >= 0"),
    ("phases: [{duration_s: 5, prefix_share: 1.5}]", r"phases\[0\]\.prefix_share: must be >= 0 and <= 1"),
    ("phases: [{duration_s: 5, output_len: {dist: zipf}}]", r"phases\[0\]\.output_len\.dist: must be one of"),
    ("phases: [{duration_s: 5, prompt_len: {dist: uniform, min: 9, max: 3}}]",
     r"phases\[0\]\.prompt_len\.max: must be >= 9"),
    ("phases: [{duration_s: five}]", r"phases\[0\]\.duration_s: must be a finite number"),
    ("phases: [{duration_s: 5, arrival_rate: .inf}]", r"phases\[0\]\.arrival_rate: must be a finite number"),
    ("phases: [{duration_s: 5, restart: maybe}]", r"phases\[0\]\.restart: must be true or false"),
    ("then: loop\nphases: [{duration_s: 5}]", r"then: must be one of repeat, hold"),
    ("engine: {block_size: 0}\nphases: [{duration_s: 5}]", r"engine\.block_size: must be >= 1"),
    ("engine: {step_base_s: 0}\nphases: [{duration_s: 5}]", r"engine\.step_base_s: must be > 0"),
    ("engine: {reserve_ratio_min: 0.9}\nphases: [{duration_s: 5}]",
     r"engine\.reserve_ratio_min: must be <= reserve_ratio_init"),
    ("engine: {num_blocks: 4}\nphases: [{duration_s: 5, prefix_len: 64}]",
     r"phases\[0\]\.prefix_len: must be shorter"),
    ("phases: [{duration_s: 5}", r"cannot read scenario"),
])
def test_a_bad_scenario_file_names_the_file_and_the_key(tmp_path, text, expected):
    path = write(tmp_path, text)
    with pytest.raises(ScenarioError, match=expected) as raised:
        load_scenario(path)
    message = str(raised.value)
    assert message.startswith(path + ": ") and "\n" not in message


def test_an_unknown_scenario_name_lists_the_built_ins():
    with pytest.raises(ScenarioError, match=r"no-such: neither a built-in scenario \(steady, kv-saturation"):
        load_scenario("no-such")
