"""Invariants of the simulator's engine model over long seeded runs, and its building blocks."""

from __future__ import annotations

import random
from collections import Counter as Multiset
from dataclasses import asdict, replace

import pytest

from kvcache_exporter.simulator.exposition import FLAVORS
from kvcache_exporter.simulator.model import KV_BOUND, BlockPool, EngineConfig, EngineModel, Request, StepEvents
from kvcache_exporter.simulator.scenarios import BUILTIN_SCENARIOS, ScenarioRun, load_scenario
from kvcache_exporter.simulator.workload import ArrivalProcess, LengthDist, Workload

# Full block-ownership reconciliation is O(pool); do it on every Nth step.
RECONCILE_EVERY = 50


class InvariantChecker:
    """Checks every step of every model of a run; fails on the first violation."""

    def __init__(self, flavor: str):
        self.reporting = FLAVORS[flavor].reporting
        self.admitted: set[int] = set()
        self.finished: set[int] = set()
        self.last_counters: dict[int, dict[str, int]] = {}
        self.steps: Multiset = Multiset()
        self.first_admissions: Multiset = Multiset()
        self.preemptions = 0
        self.max_running = 0

    def __call__(self, model: EngineModel, events: StepEvents) -> None:
        pool, config = model.pool, model.config
        assert pool.free >= 0 and pool.anonymous >= 0
        assert pool.used + len(pool.evictable) + pool.free == pool.capacity == config.num_blocks
        assert len(model.running) <= config.max_num_seqs
        self.max_running = max(self.max_running, len(model.running))
        # A preemption only ever happens when nothing is free and nothing can be evicted.
        assert events.available_at_preemption == [0] * len(events.available_at_preemption)
        self.preemptions += len(events.available_at_preemption)

        for rid in events.admitted:
            assert rid not in self.admitted, f"request {rid} admitted twice"
            self.admitted.add(rid)
        for rid in events.readmitted:
            assert rid in self.admitted and rid not in self.finished
        for rid in events.finished:
            assert rid in self.admitted and rid not in self.finished, f"request {rid} finished twice"
            self.finished.add(rid)

        key = id(model)
        self.steps[key] += 1
        self.first_admissions[key] += len(events.admitted)
        counters = dict(vars(model.counters))
        previous = self.last_counters.get(key, {name: 0 for name in counters})
        for name, value in counters.items():
            assert value >= previous[name], f"{name} went down: {previous[name]} -> {value}"
        self.last_counters[key] = counters
        self._check_histograms(model, key)
        if self.steps[key] % RECONCILE_EVERY == 0:
            self._reconcile_blocks(model)

    def _check_histograms(self, model: EngineModel, key: int) -> None:
        counters, hist = model.counters, model.histograms
        assert hist["e2e"].count == counters.finished_requests
        expected_queue = counters.finished_requests if self.reporting.queue_time_at_finish \
            else self.first_admissions[key]
        assert hist["queue"].count == expected_queue
        # Every output token is either a first token (TTFT) or follows one (ITL).
        assert hist["ttft"].count + hist["itl"].count == counters.generation_tokens
        assert hist["ttft"].count >= counters.finished_requests
        assert hist["iteration_tokens"].count == self.steps[key]
        assert sum(hist["e2e"].counts) == hist["e2e"].count

    @staticmethod
    def _reconcile_blocks(model: EngineModel) -> None:
        """The pool's books agree with what the running requests hold, and the queue holds nothing."""
        pool, size = model.pool, model.config.block_size
        refs: Multiset = Multiset()
        anonymous = 0
        for request in model.running:
            assert -(-request.computed // size) <= len(request.blocks) <= -(-request.target // size)
            for key in request.blocks:
                if key is None:
                    anonymous += 1
                else:
                    refs[key] += 1
        assert anonymous == pool.anonymous
        assert dict(refs) == pool.held
        assert not set(pool.held) & set(pool.evictable)
        assert all(not request.blocks for request in model.waiting)


SCENARIO_FLAVOR_SEEDS = [
    (scenario, flavor, seed)
    for seed_base, scenario in enumerate(BUILTIN_SCENARIOS)
    for offset, flavor in enumerate(FLAVORS)
    for seed in [seed_base * 10 + offset]
]


@pytest.mark.parametrize("scenario,flavor,seed", SCENARIO_FLAVOR_SEEDS)
def test_invariants_hold_over_a_full_cycle(scenario, flavor, seed):
    sc = load_scenario(scenario)
    checker = InvariantChecker(flavor)
    run = ScenarioRun(sc, FLAVORS[flavor].reporting, seed=seed)
    # A full cycle and into the repeat, so that every phase change (and restart) is crossed.
    run.advance_to(sc.cycle_s + 30, on_step=checker)

    assert sum(checker.steps.values()) > 10_000
    assert len(checker.finished) > 500
    assert checker.max_running > 0
    if scenario == "kv-saturation":
        assert checker.preemptions > 100  # the exhaustion check above was exercised
    if scenario == "concurrency-cap":
        assert checker.max_running == sc.engine.max_num_seqs
    if scenario == "restart":
        assert run.generation == 1  # at 180 s; the repeat from 360 s restarts again only at 540 s


def test_data_parallel_ranks_share_the_arrivals_and_keep_the_invariants():
    sc = load_scenario("steady")
    checker = InvariantChecker("sglang")
    run = ScenarioRun(sc, FLAVORS["sglang"].reporting, seed=9, dp=2)
    run.advance_to(300, on_step=checker)
    finished = [model.counters.finished_requests for model in run.models]
    assert len(run.models) == 2 and min(finished) > 0.4 * sum(finished)
    assert sum(finished) == len(checker.finished) > 700


def test_result_does_not_depend_on_how_time_is_cut_up():
    reporting = FLAVORS["vllm-v1"].reporting
    sc = load_scenario("kv-saturation")
    whole = ScenarioRun(sc, reporting, seed=3)
    whole.advance_to(400)
    pieces = ScenarioRun(sc, reporting, seed=3)
    t = 0.0
    rng = random.Random(1)
    while t < 400:
        t = min(400, t + rng.uniform(0.01, 7))
        pieces.advance_to(t)
    assert asdict(whole.models[0].counters) == asdict(pieces.models[0].counters)
    assert whole.models[0].counters.preemptions > 0
    assert whole.models[0].histograms["ttft"].counts == pieces.models[0].histograms["ttft"].counts


def test_same_seed_same_run_and_other_seed_other_run():
    reporting = FLAVORS["sglang"].reporting
    sc = load_scenario("steady")
    counters = []
    for seed in (5, 5, 6):
        run = ScenarioRun(sc, reporting, seed=seed)
        run.advance_to(120)
        counters.append(asdict(run.models[0].counters))
    assert counters[0] == counters[1]
    assert counters[0] != counters[2]


# -- building blocks ----------------------------------------------------------------------------

def test_block_pool_evicts_least_recently_released_first_and_counts_evictable_as_available():
    pool = BlockPool(3)
    for _ in range(3):
        assert pool.allocate()
    assert not pool.allocate() and pool.available == 0
    for key in ("a", "b", "c"):
        assert pool.seal(key)
    assert pool.used == 3
    pool.release("b")
    pool.release("a")
    assert (pool.used, len(pool.evictable), pool.free, pool.available) == (1, 2, 0, 2)
    assert pool.allocate()  # evicts "b", released first
    assert not pool.is_cached("b") and pool.is_cached("a")
    pool.acquire_cached("a")  # a hit takes it back out of the evictable set
    assert pool.held == {"a": 1, "c": 1} and not pool.evictable and pool.available == 0


def test_duplicate_content_stays_anonymous_and_returns_to_free():
    pool = BlockPool(2)
    pool.allocate()
    pool.allocate()
    assert pool.seal("x")
    assert not pool.seal("x")  # a second copy of cached content is not cached again
    assert (pool.anonymous, pool.held) == (1, {"x": 1})
    pool.release(None)
    assert pool.free == 1


def _model(**config) -> EngineModel:
    return EngineModel(EngineConfig(**config), FLAVORS["vllm-v1"].reporting)


def test_shared_prefix_blocks_are_reused_and_hits_leave_one_token_to_compute():
    model = _model(num_blocks=64, block_size=16)
    first = Request(0, 0.0, prompt_len=64, output_len=4, prefix_id=7, prefix_len=64)
    model.submit(first)
    model.advance_to(5)
    assert model.counters.finished_requests == 1
    assert model.counters.prefix_hit_tokens == 0
    # Same 64-token prefix, nothing else: all 4 blocks cached, but at most 63 tokens may hit.
    second = Request(1, 5.0, prompt_len=64, output_len=4, prefix_id=7, prefix_len=64)
    model.submit(second)
    model.advance_to(10)
    assert model.counters.prefix_queried_tokens == 128
    assert model.counters.prefix_hit_tokens == 48
    assert model.counters.finished_cached_tokens == 48


def test_preemption_frees_the_newest_request_and_it_recomputes_later():
    # 5 blocks of 4 tokens; two requests that each grow to 12 tokens (3 blocks) cannot both
    # fit, and nothing holds room back for them (reserve_ratio_init 0: vLLM's admission).
    model = _model(num_blocks=5, block_size=4, max_model_len=20, reserve_ratio_init=0.0, reserve_ratio_min=0.0,
                   enable_prefix_caching=False)
    model.submit(Request(0, 0.0, prompt_len=4, output_len=9))
    model.submit(Request(1, 0.0, prompt_len=4, output_len=9))
    events_seen = []
    model.advance_to(10, on_step=lambda m, e: events_seen.append(e))
    preempting = [e for e in events_seen if e.available_at_preemption]
    assert preempting, "the pool ran out, so someone must have been preempted"
    assert model.counters.preemptions >= 1
    assert model.counters.preemptions_rescheduled == model.counters.preemptions  # both re-scheduled
    assert model.counters.finished_requests == 2
    assert model.pool.used == 0 and model.pool.free == 5


def test_waiting_reason_tells_the_running_cap_from_kv():
    capped = _model(num_blocks=256, max_num_seqs=1)
    kv_bound = _model(num_blocks=8, block_size=16, max_model_len=128)
    for model in (capped, kv_bound):
        for rid in range(3):
            model.submit(Request(rid, 0.0, prompt_len=60, output_len=60))
        model.step()
    assert (len(capped.running), capped.waiting_reason) == (1, "cap")
    assert (len(kv_bound.running), kv_bound.waiting_reason) == (1, "kv")


def test_a_head_that_a_finish_freed_room_for_is_told_from_one_kv_holds_back():
    """8 blocks of 16 tokens: a 100-token prompt with one output token holds 7 of them and finishes in its first
    step; the 60-token prompt behind it needs 4, so KV holds it back at that step's admission. The finish frees
    the 7: the page after the step shows a queue of 1 beside 8 free blocks, reason "freed"; the next step
    admits it. Without the finish (the first request decoding on) the reason stays "kv"."""
    for output_len, reason, used in ((1, "freed", 0), (2, "kv", 7)):
        model = _model(num_blocks=8, block_size=16, max_model_len=128)
        model.submit(Request(0, 0.0, prompt_len=100, output_len=output_len))
        model.submit(Request(1, 0.0, prompt_len=60, output_len=4))
        model.step()
        assert (model.waiting_reason, model.report.waiting_reason) == (reason, reason)
        assert (model.report.waiting, model.report.used_blocks) == (1, used)
        if reason == "freed":
            model.step()
            assert ([r.id for r in model.running], model.waiting_reason, model.pool.used) == ([1], None, 4)


def test_latencies_come_from_the_step_clock():
    # One request, prompt in one step: TTFT = one prefill step, ITL = one decode step each.
    model = _model(step_base_s=0.01, step_per_token_s=0.001)
    model.submit(Request(0, 0.0, prompt_len=100, output_len=3))
    model.advance_to(1)
    ttft, itl, e2e = (model.histograms[k] for k in ("ttft", "itl", "e2e"))
    assert ttft.sum == pytest.approx(0.01 + 0.1)
    assert (itl.count, itl.sum) == (2, pytest.approx(2 * 0.011))
    assert e2e.sum == pytest.approx(0.11 + 0.022)


def test_arrivals_follow_the_rate_and_respect_the_length_limits():
    workload = Workload(arrival_rate=10.0, prompt_len=LengthDist(kind="uniform", low=100, high=5000),
                        output_len=LengthDist(median=3000, sigma=1.0, low=1, high=9000),
                        prefix_share=0.5, num_prefixes=3, prefix_len=256)
    arrivals = ArrivalProcess(workload, random.Random(0), max_model_len=4096)
    requests = arrivals.until(1000.0)
    assert 9_500 < len(requests) < 10_500
    assert all(r.prompt_len + r.output_len <= 4096 for r in requests)
    assert all(r.output_len <= 2048 and r.prompt_len >= 1 for r in requests)
    prefixed = [r for r in requests if r.prefix_id is not None]
    assert 0.45 < len(prefixed) / len(requests) < 0.55
    assert {r.prefix_id for r in prefixed} == {0, 1, 2}
    assert all(r.prefix_len <= r.prompt_len for r in prefixed)
    arrivals.set_workload(replace(workload, arrival_rate=0.0), 1000.0)
    assert arrivals.until(1e9) == []


def test_an_evicted_block_goes_to_the_offload_tier_and_a_later_hit_loads_it_back():
    # 4 GPU blocks of 4 tokens; a 12-token prefix (3 blocks) is cached, then pushed out of the pool by
    # another request's blocks, then asked for again: it comes back from the tier, not recomputed.
    model = _model(num_blocks=4, block_size=4, max_model_len=16, offload_blocks=8, reserve_ratio_init=0.0,
                   reserve_ratio_min=0.0, offload_load_bytes_per_s=1e9, kv_bytes_per_token=1000)
    model.submit(Request(0, 0.0, prompt_len=12, output_len=1, prefix_id=1, prefix_len=12))
    model.submit(Request(1, 1.0, prompt_len=16, output_len=1))  # needs all 4 blocks: evicts the prefix
    model.advance_to(2)
    counters = model.counters
    # The pool evicts a released request's tail first, so the tier receives the prefix back to front.
    assert counters.offload_stored_blocks == 3 and list(model.tier.blocks) == [("prefix", 1, i) for i in (2, 1, 0)]
    model.submit(Request(2, 2.0, prompt_len=13, output_len=1, prefix_id=1, prefix_len=12))
    model.advance_to(3)
    # 3 blocks = 12 tokens hit, all from the CPU; 12 x 1000 bytes at 1e9 bytes/s.
    assert (counters.prefix_hit_tokens, counters.offload_hit_tokens, counters.offload_loaded_blocks) == (0, 12, 3)
    assert counters.offload_queried_tokens == 12 + 16 + 13  # every prompt token the GPU pool did not have
    assert counters.offload_load_seconds == pytest.approx(12 * 1000 / 1e9)
    assert counters.finished_cached_tokens == counters.finished_offload_cached_tokens == 12


def test_the_offload_tier_evicts_least_recently_used_first():
    from kvcache_exporter.simulator.model import OffloadTier

    tier = OffloadTier(2, store_seconds_per_block=0.0)
    assert (tier.store(["a"], 0.0), tier.store(["b"], 0.0)) == ((1, 0), (1, 0))
    tier.touch("a")
    assert tier.store(["c"], 0.0) == (1, 1) and list(tier.blocks) == ["a", "c"]


def test_a_store_in_flight_pins_its_blocks_and_an_allocation_without_room_stores_nothing():
    """As vLLM's LRU offloading manager: a block is evictable (and loadable) once its store completed;
    an allocation that cannot evict enough stores none of its blocks and evicts nothing."""
    from kvcache_exporter.simulator.model import OffloadTier

    tier = OffloadTier(3, store_seconds_per_block=1.0)  # one link, 1 s a block
    assert tier.store(["a"], 0.0) == (1, 0)  # done at 1
    assert tier.store(["b", "c"], 0.0) == (2, 0)  # queued behind "a": done at 1 + 2 = 3
    assert tier.blocks == {"a": 1.0, "b": 3.0, "c": 3.0}
    assert (tier.is_ready("a", 2.0), tier.is_ready("b", 2.0), tier.pinned(2.0)) == (True, False, 2)
    assert tier.store(["d", "e"], 2.0) is None  # two to evict, one unpinned ("a")
    assert list(tier.blocks) == ["a", "b", "c"]
    assert tier.store(["c", "d"], 2.0) == (1, 1)  # "c" is kept already: one new block, "a" makes room
    assert tier.blocks == {"b": 3.0, "c": 3.0, "d": 4.0} and list(tier.blocks) == ["b", "c", "d"]
    assert tier.store(["e"], 3.5) == (1, 1) and "b" not in tier.blocks  # "b" is done by now: evictable


def test_the_offload_tier_scenario_serves_most_cached_tokens_from_the_cpu():
    """The offload-tier scenario: the same seed with and without the tier, numbers from the models' counters."""
    from kvcache_exporter.simulator.scenarios import override_engine

    scenario = load_scenario("offload-tier")
    with_tier = ScenarioRun(scenario, FLAVORS["vllm-v1"].reporting, seed=0)
    without = ScenarioRun(override_engine(scenario, {"offload_blocks": 0}), FLAVORS["vllm-v1"].reporting, seed=0)
    with_tier.advance_to(600)
    without.advance_to(600)
    tiered, plain = with_tier.models[0].counters, without.models[0].counters
    assert len(with_tier.models[0].tier.blocks) <= scenario.engine.offload_blocks
    assert tiered.offload_hit_tokens > 2 * tiered.prefix_hit_tokens  # most hits come from the CPU
    cached = lambda c: (c.prefix_hit_tokens + c.offload_hit_tokens) / c.prefix_queried_tokens  # noqa: E731
    assert cached(tiered) > 3 * cached(plain)
    # Recompute: prefill tokens computed per prompt token queried fall by more than a third.
    computed = lambda c: c.prefill_compute_tokens / c.prefix_queried_tokens  # noqa: E731
    assert computed(tiered) < 0.67 * computed(plain)
    assert tiered.offload_loaded_blocks * scenario.engine.block_size >= tiered.offload_hit_tokens


def test_the_tier_full_scenario_refuses_stores_while_the_gpu_pool_is_saturated():
    """offload-tier-full: after its first minute, every minute has refused allocations, a queue waiting for KV
    and a tier holding its capacity; offload-tier (a large tier at the default bandwidth) never refuses."""
    full = ScenarioRun(load_scenario("offload-tier-full"), FLAVORS["vllm-v1"].reporting, seed=0)
    config = full.scenario.engine
    refused = []
    for minute in range(1, 11):
        before = full.models[0].counters.offload_store_failures
        full.advance_to(60 * minute)
        model = full.models[0]
        refused.append(model.counters.offload_store_failures - before)
        if minute > 1:
            assert model.waiting_reason in KV_BOUND and model.report.waiting > 0, minute
            assert len(model.tier.blocks) == config.offload_blocks, minute
    assert min(refused[1:]) > 0, refused
    counters = full.models[0].counters
    assert counters.preemptions > 0 and counters.offload_stored_blocks > 0
    steady = ScenarioRun(load_scenario("offload-tier"), FLAVORS["vllm-v1"].reporting, seed=0)
    steady.advance_to(600)
    assert steady.models[0].counters.offload_store_failures == 0
    assert steady.models[0].counters.offload_evicted_blocks > 0  # it was full too, but could always evict
