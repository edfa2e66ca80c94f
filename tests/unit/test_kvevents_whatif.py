"""The what-if against reality: the simulator with a pool of C blocks and the same workload with 2C. The
prefix-cache hit tokens the larger pool actually gained (the simulator's own counters) agree with what
the C pool's capacity-miss distance histogram predicted (misses at ratio <= 1, times the block size).

The C pool's stream goes through the simulator's publisher encoding and the exporter's decoder."""

from __future__ import annotations

import random
from collections import OrderedDict

import pytest

from kvcache_exporter.blocks import PoolState
from kvcache_exporter.contract import DISTANCE_BUCKETS, WHAT_IF_FACTORS
from kvcache_exporter.sources.kvevents import REMOVED, STORED, BlockEvent, decode_payload
from kvcache_exporter.simulator import kvevents as sim_events
from kvcache_exporter.simulator.exposition import FLAVORS
from kvcache_exporter.simulator.scenarios import ScenarioRun, load_scenario, override_engine

CAPACITY = 1024
BLOCK_SIZE = 16
# Every prompt starts with one of 40 prefixes of 512 tokens (32 blocks each, 1280 in all: more than the
# pool holds), a light load that never preempts: the pool's cached blocks are evicted least recently
# released first, and what decides a hit is whether a prefix's blocks survived since its last use.
LRU_WORKLOAD = """
name: lru-prefixes
then: hold
phases:
  - name: prefixes
    duration_s: 1800
    arrival_rate: 1
    prompt_len: {dist: lognormal, median: 64, sigma: 0.5, min: 16, max: 400}
    output_len: {dist: lognormal, median: 40, sigma: 0.5, min: 8, max: 200}
    prefix_share: 1.0
    num_prefixes: 40
    prefix_len: 512
"""


def run(path, num_blocks: int, seed: int):
    scenario = override_engine(load_scenario(str(path)), {"num_blocks": num_blocks, "block_size": BLOCK_SIZE})
    engine = ScenarioRun(scenario, FLAVORS["vllm-v1"].reporting, seed=seed, record_kv_events=True)
    pool = PoolState(capacity=num_blocks)
    seq, now = 0, 0.0
    while now < 1800:
        now += 30
        engine.advance_to(now)
        model = engine.models[0]
        for ts, journal in model.kv_batches:
            payload = sim_events.batch(ts, sim_events.events(journal, BLOCK_SIZE, signed=False), 0)
            batch = decode_payload(seq, payload, 1 << 24)
            pool.apply(batch.ts, batch.events)
            seq += 1
        model.kv_batches.clear()
    return engine.models[0].counters, pool


@pytest.mark.parametrize("seed", [1, 2])
def test_hits_a_pool_twice_as_large_gains_are_what_the_histogram_predicted(tmp_path, seed):
    path = tmp_path / "lru.yml"
    path.write_text(LRU_WORKLOAD)
    small, pool = run(path, CAPACITY, seed)
    large, _ = run(path, 2 * CAPACITY, seed)
    assert small.preemptions == large.preemptions == 0  # the LRU premise: nothing but eviction moves blocks
    assert small.prefix_queried_tokens == large.prefix_queried_tokens  # the same requests
    gained = large.prefix_hit_tokens - small.prefix_hit_tokens
    predicted = dict(pool.distance.cumulative())[1.0] * BLOCK_SIZE
    print(f"seed {seed}: hits C {small.prefix_hit_tokens}, 2C {large.prefix_hit_tokens}: gained {gained} tokens; "
          f"predicted {predicted} ({predicted / gained - 1:+.1%}); capacity misses {pool.capacity_misses}")
    assert gained > 0.1 * small.prefix_queried_tokens  # the larger pool matters on this workload
    assert abs(predicted / gained - 1) < 0.10


def lru_trace(capacity: int, accesses: int, seed: int) -> list[tuple[str, int]]:
    """The events of a pool of `capacity` blocks evicting least recently used first, as (kind, hash): a hot set
    of 1.5 x capacity that keeps coming back (most evictions are of blocks stored again soon) and a cold set of
    8 x capacity whose blocks come back from every depth, below and beyond 4 x capacity."""
    rng = random.Random(seed)
    hot, cold = int(1.5 * capacity), 8 * capacity
    pool: OrderedDict[int, None] = OrderedDict()
    trace = []
    for _ in range(accesses):
        key = rng.randrange(hot) if rng.random() < 0.7 else hot + rng.randrange(cold)
        if key in pool:
            pool.move_to_end(key)  # a hit: no event
            continue
        if len(pool) == capacity:
            trace.append((REMOVED, pool.popitem(last=False)[0]))
        pool[key] = None
        trace.append((STORED, key))
    return trace


def replay_definition(trace: list[tuple[str, int]], capacity: int) -> list[float]:
    """docs/kv-events.md's definition, replayed as written: a block stored again while on the list of recent
    evictions is a capacity miss, at distance (the blocks evicted after it and not stored again since) /
    capacity; the list keeps the blocks still out with fewer than 4 x capacity evicted after them. The distance
    ratio of every capacity miss."""
    out: list[int] = []  # blocks evicted and still out, in the order they left
    ratios = []
    own = 0  # evictions since the last store: the storing request's own, after its lookup
    for kind, key in trace:
        if kind == REMOVED:
            out.append(key)
            del out[:-4 * capacity]
            own += 1
            continue
        if key in out:
            at = out.index(key)
            ratios.append((len(out) - 1 - at - own) / capacity)
            del out[at]
        own = 0
    return ratios


@pytest.mark.parametrize("seed", [1, 2])
def test_capacity_misses_and_the_distance_buckets_equal_an_exact_replay_of_the_definition(seed):
    capacity = 64
    trace = lru_trace(capacity, 200_000, seed)
    pool = PoolState(capacity=capacity)
    # Each store ends with the block of its request's last token, never a capacity miss (blocks.never_a_hit):
    # one that stays cached here, outside this trace's LRU, so that the trace's blocks are what is counted.
    last_token_block = -1
    for kind, key in trace:
        pool.apply(0.0, [BlockEvent(kind, [key, last_token_block] if kind == STORED else [key])])
    ratios = replay_definition(trace, capacity)
    cumulative = dict(pool.distance.cumulative())
    expected = {bound: sum(ratio <= bound for ratio in ratios) for bound in DISTANCE_BUCKETS}
    print(f"seed {seed}: {len(trace)} events, {len(ratios)} capacity misses, le=4: {expected[4.0]}, "
          f"le=1: {expected[1.0]}; list of evictions {len(pool._ghost_keys)} positions, {len(pool.ghost)} out")
    assert len(ratios) > 20_000 and expected[1.0] < expected[2.0] < expected[4.0]  # every bucket has its own
    assert pool.capacity_misses == len(ratios)
    assert {bound: cumulative[bound] for bound in DISTANCE_BUCKETS} == expected
    assert len(pool._ghost_keys) < 2 * 4 * capacity  # the memory bound: 2 x the list's limit


def test_every_factor_the_rules_ship_keeps_a_bucket_of_its_own():
    """What a pool `factor` times as large keeps is the count of the bucket le = factor - 1, never an interpolation
    between two bounds (whose error has no bound of its own: all the misses between them on one side)."""
    assert all(factor - 1 in DISTANCE_BUCKETS for factor in WHAT_IF_FACTORS)
