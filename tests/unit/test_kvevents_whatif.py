"""The what-if against reality: the simulator with a pool of C blocks and the same workload with 2C. The
prefix-cache hit tokens the larger pool actually gained (the simulator's own counters) agree with what
the C pool's capacity-miss distance histogram predicted (misses at ratio <= 1, times the block size).

The C pool's stream goes through the simulator's publisher encoding and the exporter's decoder."""

from __future__ import annotations

import pytest

from kvcache_exporter.blocks import PoolState
from kvcache_exporter.sources.kvevents import decode_payload
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
