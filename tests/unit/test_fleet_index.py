"""The fleet index (exporter/fleet.py) on hand-built event sequences: which replica recomputed what a sibling held,
matched by content across hash seeds, by hash where no token ids come, and sampled beyond its size."""

from __future__ import annotations

import random

import pytest

from kvcache_exporter import config as cfg
from kvcache_exporter.fleet import FleetIndex
from kvcache_exporter.simulator import kvevents as sim_events
from kvcache_exporter.simulator.exposition import FLAVORS
from kvcache_exporter.simulator.scenarios import ScenarioRun, load_scenario, override_engine
from kvcache_exporter.sources.kvevents import CLEARED, REMOVED, STORED, BlockEvent, decode_message, decode_payload
from devtools import kvevents_wire as wire

BLOCK = 16


def tokens(seed: int, blocks: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(32000) for _ in range(blocks * BLOCK)]


def seeded(seed: int, values) -> list[int]:
    """Engine hashes under a per-engine seed: the same content, other hashes on another engine."""
    return [hash((seed, value)) & (2**64 - 1) for value in values]


def store(hashes, token_ids=None, parent=None) -> BlockEvent:
    """A store of whole blocks; without token ids, as a stream that sends hashes only."""
    return BlockEvent(STORED, list(hashes), parent=parent, token_ids=token_ids, block_size=BLOCK)


def test_a_prefix_a_sibling_holds_is_recomputed_tokens_even_with_other_hash_seeds():
    index = FleetIndex(1000)
    prefix = tokens(1, 3)
    index.apply("a", "m", [store(seeded(1, "xyz"), prefix)])
    index.apply("b", "m", [store(seeded(2, "xyz"), prefix)])  # the same 3 blocks, other hashes
    fleet = index.models["m"]
    assert fleet.recomputed_tokens == 3 * BLOCK
    assert fleet.stored_tokens == 6 * BLOCK
    assert fleet.hash_mismatch_blocks == 3
    # The chain: a 4th block stored on b after its parent, and on a the same block after a's parent.
    tail = tokens(2, 1)
    index.apply("a", "m", [store(seeded(1, "w"), tail, parent=seeded(1, "z")[0])])
    index.apply("b", "m", [store(seeded(2, "w"), tail, parent=seeded(2, "z")[0])])
    assert fleet.recomputed_tokens == 4 * BLOCK
    # The same tokens after another parent are other KV: no match.
    index.apply("b", "m", [store(seeded(2, "v"), tail, parent=seeded(2, "y")[0])])
    assert fleet.recomputed_tokens == 4 * BLOCK


def test_nothing_is_recomputed_once_the_sibling_evicted_it_or_on_another_model():
    index = FleetIndex(1000)
    prefix = tokens(3, 2)
    index.apply("a", "m", [store([1, 2], prefix)])
    index.apply("c", "other", [store([5, 6], prefix)])
    index.apply("a", "m", [BlockEvent(REMOVED, [1, 2])])
    index.apply("b", "m", [store([11, 12], prefix)])
    assert index.models["m"].recomputed_tokens == 0
    index.apply("b", "m", [BlockEvent(CLEARED, [])])
    index.apply("a", "m", [store([1, 2], prefix)])
    assert index.models["m"].recomputed_tokens == 0 and index.tracked == 4  # a's 2 and c's 2


def test_a_copy_of_a_held_block_is_no_recompute_and_its_removal_keeps_the_block():
    index = FleetIndex(1000)
    prefix = tokens(4, 1)
    index.apply("a", "m", [store([1], prefix), store([1], prefix)])  # vLLM's recomputed last block: a 2nd copy
    index.apply("a", "m", [BlockEvent(REMOVED, [1])])
    index.apply("b", "m", [store([9], prefix)])
    assert index.models["m"].recomputed_tokens == BLOCK


def test_hash_only_stores_meet_only_where_the_hashes_do():
    index = FleetIndex(1000)
    index.apply("a", "m", [store([1, 2])])
    index.apply("b", "m", [store([1, 2])])  # a shared seed: the same hashes
    index.apply("c", "m", [store([71, 72])])  # another seed
    fleet = index.models["m"]
    assert fleet.recomputed_tokens == 2 * BLOCK and fleet.hash_only_blocks == 6


def test_a_replica_whose_hashes_never_meet_its_siblings_is_counted_and_the_others_not():
    index = FleetIndex(10**6)
    shared = range(1, 300)
    index.apply("a", "m", [store(shared)])
    index.apply("b", "m", [store(shared)])
    assert index.models["m"].isolated() == 0  # two replicas: no reference to tell a cold workload apart
    index.apply("c", "m", [store(seeded(3, shared))])  # hash-only with its own seed
    assert index.models["m"].isolated() == 1
    # A fourth replica on a workload of its own that met nobody yet is below the minimum: not counted.
    index.apply("d", "m", [store(range(10_000, 10_010))])
    assert index.models["m"].isolated() == 1


def test_the_index_samples_beyond_its_size_and_scales_the_counts():
    rng = random.Random(7)
    prefixes = [tokens(100 + n, 1) for n in range(4000)]
    exact, sampled = FleetIndex(10**6), FleetIndex(2000)
    for index in (exact, sampled):
        for n, prefix in enumerate(prefixes):
            index.apply("a", "m", [store([n], prefix)])
    for n in rng.sample(range(4000), 3000):
        for index in (exact, sampled):
            index.apply("b", "m", [store([10**6 + n], prefixes[n])])
    truth = exact.models["m"].recomputed_tokens
    assert truth == 3000 * BLOCK and exact.rate == 1.0
    assert sampled.tracked <= 2000 and sampled.rate <= 0.25
    # Binomial over the 3,000 distinct matched blocks at rate r: 4 standard errors, sqrt((1 - r) / (r n)).
    rate = sampled.rate
    bound = 4 * ((1 - rate) / (rate * 3000)) ** 0.5
    assert abs(sampled.models["m"].recomputed_tokens - truth) / truth <= bound


def test_token_ids_are_decoded_only_when_asked_for():
    message = wire.message("vllm-map", 0, 1.0, [wire.stored("vllm-map", [1, 2], block_size=BLOCK)])
    with_tokens = decode_message(message, 1 << 20, token_ids=True).events[0]
    assert with_tokens.token_ids == list(range(2 * BLOCK)) and with_tokens.block_size == BLOCK
    without = decode_message(message, 1 << 20).events[0]
    # Tokens per block are read either way (kvcache_events_block_size_tokens); the token ids only when asked for.
    assert without.token_ids is None and without.block_size == BLOCK


def test_fleet_index_config_and_its_errors(tmp_path):
    path = tmp_path / "exporter.yml"
    path.write_text("targets: [{url: 'http://127.0.0.1:1/metrics'}]\nfleet_index: {enabled: true, max_blocks: 5}\n")
    settings = cfg.load_file(str(path))
    assert cfg.build(str(path), settings).fleet_index == cfg.FleetIndexConfig(True, 5)
    path.write_text("targets: []\nfleet_index: {enabled: yes please}\n")
    with pytest.raises(cfg.ConfigError, match=r"exporter.yml: fleet_index.enabled: must be true or false"):
        cfg.load_file(str(path))
    with pytest.raises(cfg.ConfigError, match=r"fleet_index.enabled: needs every replica's stream in one process"):
        cfg.build("exporter.yml", {"fleet_index": cfg.FleetIndexConfig(True), "workers": 2})


SIMULATED = """
name: shared-prefixes
then: hold
phases:
  - {name: prefixes, duration_s: 600, arrival_rate: 2, prefix_share: 0.8, num_prefixes: 6, prefix_len: 128,
     prompt_len: {dist: lognormal, median: 64, sigma: 0.5, min: 16, max: 300},
     output_len: {dist: lognormal, median: 20, sigma: 0.5, min: 8, max: 100}}
"""


def simulated_loss(tmp_path, router: str) -> tuple[float, float]:
    """Two DP ranks of a simulated vLLM under `router`, their streams through the wire into one fleet index: the
    tokens recomputed while the other rank held them, and the tokens stored."""
    path = tmp_path / "prefixes.yml"
    path.write_text(SIMULATED)
    scenario = override_engine(load_scenario(str(path)), {"num_blocks": 512, "block_size": BLOCK})
    run = ScenarioRun(scenario, FLAVORS["vllm-v1"].reporting, seed=5, dp=2, record_kv_events=True, router=router)
    index = FleetIndex(10**6)
    for now in range(30, 601, 30):
        run.advance_to(now)
        for rank, model in enumerate(run.models):
            for ts, journal in model.kv_batches:
                payload = sim_events.batch(ts, sim_events.events(journal, BLOCK, False), rank)
                index.apply(rank, "m", decode_payload(0, payload, 1 << 24, token_ids=True).events)
            model.kv_batches.clear()
    fleet = index.models["m"]
    return fleet.recomputed_tokens, fleet.stored_tokens


def test_the_simulators_routers_lose_and_keep_the_prefixes(tmp_path):
    # Round-robin: every prefix is computed on both ranks, at least once each (6 prefixes x 128 tokens = 8 blocks
    # each); prefix affinity: each prefix lives on one rank, and nothing else repeats (the tails are the requests'
    # own), so no rank ever computes what the other holds.
    lost, stored = simulated_loss(tmp_path, "round-robin")
    assert lost >= 6 * 128 and lost < stored
    assert simulated_loss(tmp_path, "prefix-affinity")[0] == 0
