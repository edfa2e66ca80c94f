"""The simulator's KV events as the engines send them (simulator/kvevents.py): vLLM 0.32's BlockStored (one
chain per event, the parent's hash, token ids, `group_idx` 0, the untagged `extra_keys` with the adapter on
every block and the cache salt on a request's first block only), SGLang's salt on every store; and what the
exporter makes of them: every block held by the simulator's holder, a later block by its chain's tenant."""

from __future__ import annotations

from collections import Counter

import msgpack

from kvcache_exporter.blocks import PoolState
from kvcache_exporter.simulator import kvevents as sim_events
from kvcache_exporter.simulator.exposition import FLAVORS
from kvcache_exporter.simulator.model import REMOVED, STORED
from kvcache_exporter.simulator.scenarios import ScenarioRun, load_scenario, override_engine
from kvcache_exporter.simulator.workload import TENANTS, holder
from kvcache_exporter.sources.kvevents import decode_payload, tenant_of
from kvcache_exporter.tiers import Tiers

BLOCK_SIZE = 4
# Owner 1: adapter sql-lora, tenant-1. Owner 2: chat-lora, tenant-2 (prefix 2's requests). Owner 3: no adapter,
# tenant-3. Owner 4: sql-lora, tenant-0 (4 % 3 and 4 % 4).
JOURNAL = [
    (STORED, (1, 0), None, 1), (STORED, (1, 1), (1, 0), 1), (STORED, (1, 2), (1, 1), 1),  # request 1, blocks 0-2
    (STORED, ("prefix", 2, 0), None, 2), (STORED, ("prefix", 2, 1), ("prefix", 2, 0), 2),  # prefix 2 ...
    (STORED, (5, 2), ("prefix", 2, 1), 2),  # ... and its request 5's own next block: one chain
    (REMOVED, (9, 9)),
    (STORED, (3, 0), None, 3), (STORED, (3, 1), (3, 0), 3),  # no adapter: the salt alone, on block 0
    (STORED, (3, 2), (3, 1), 3),
    (STORED, (7, 2), (7, 1), 4), (STORED, (7, 3), (7, 2), 4),  # a later step of request 7: no salt
    (STORED, (3, 3), (3, 2), 3),  # no adapter, no salt: no extra_keys at all
]


def h(key) -> int:
    return sim_events.block_hash(key)


def test_vllm_stores_are_chains_with_the_salt_on_a_requests_first_block_only():
    events = sim_events.events(JOURNAL, BLOCK_SIZE, signed=False)
    assert [e["type"] for e in events] == ["BlockStored", "BlockStored", "BlockRemoved", "BlockStored",
                                           "BlockStored", "BlockStored"]
    first, prefixed, removed, salted, later, bare = events
    assert first["block_hashes"] == [h((1, 0)), h((1, 1)), h((1, 2))] and first["parent_block_hash"] is None
    assert first["extra_keys"] == [["sql-lora", "tenant-1"], ["sql-lora"], ["sql-lora"]]
    assert (first["lora_name"], first["lora_id"], first["group_idx"], first["medium"]) == ("sql-lora", 1, 0, "GPU")
    assert len(first["token_ids"]) == 3 * BLOCK_SIZE and first["block_size"] == BLOCK_SIZE
    assert prefixed["block_hashes"] == [h(("prefix", 2, 0)), h(("prefix", 2, 1)), h((5, 2))]
    assert prefixed["extra_keys"] == [["chat-lora", "tenant-2"], ["chat-lora"], ["chat-lora"]]
    assert removed == {"type": "BlockRemoved", "block_hashes": [h((9, 9))], "medium": "GPU"}
    assert salted["extra_keys"] == [["tenant-3"], None, None] and salted["lora_name"] is None
    assert salted["lora_id"] is None
    assert later["parent_block_hash"] == h((7, 1)) and later["extra_keys"] == [["sql-lora"], ["sql-lora"]]
    assert bare["parent_block_hash"] == h((3, 2)) and "extra_keys" not in bare
    assert not any("cache_salt" in e for e in events)


def test_sglang_names_the_salt_on_every_store_and_signs_its_hashes():
    events = sim_events.events(JOURNAL, BLOCK_SIZE, signed=True)
    stored = [e for e in events if e["type"] == "BlockStored"]
    assert [e["cache_salt"] for e in stored] == ["tenant-1", "tenant-2", "tenant-3", "tenant-0", "tenant-3"]
    assert all("extra_keys" not in e and "group_idx" not in e for e in stored)
    signed = [value for e in events for value in e["block_hashes"]]
    assert all(-(1 << 63) <= value < 1 << 63 for value in signed)
    assert [value % (1 << 64) for value in stored[0]["block_hashes"]] == [h((1, 0)), h((1, 1)), h((1, 2))]


def decoded_pool(journal) -> PoolState:
    pool = PoolState(capacity=64)
    payload = sim_events.batch(1.0, sim_events.events(journal, BLOCK_SIZE, signed=False), 0)
    batch = decode_payload(0, payload, 1 << 20)
    pool.apply(batch.ts, batch.events)
    return pool


def test_the_exporter_holds_every_block_by_its_chains_adapter_and_tenant():
    pool = decoded_pool([entry for entry in JOURNAL if entry[0] == STORED and entry[1][0] != 7])
    # By the journal: request 1's three blocks, prefix 2's chain of three, request 3's four.
    expected_tenants = {tenant_of("tenant-1"): 3, tenant_of("tenant-2"): 3, tenant_of("tenant-3"): 4}
    assert {name: counts[1] for name, counts in pool.tenants.counts.items()} == expected_tenants
    assert {name: counts[1] for name, counts in pool.adapters.counts.items()} == {"sql-lora": 3, "chat-lora": 3,
                                                                                  "base": 4}


def test_a_chain_whose_first_store_was_missed_has_no_tenant():
    """Request 7's later blocks name no salt and their parent was never seen: the exporter cannot tell whose
    they are (an exporter started after a long-lived prefix was stored sees this until it is stored again)."""
    pool = decoded_pool([entry for entry in JOURNAL if entry[1][0] == 7])
    assert {name: counts[1] for name, counts in pool.tenants.counts.items()} == {"none": 2}


WORKLOAD = """
name: tenants
then: hold
phases:
  - name: mixed
    duration_s: 600
    arrival_rate: 2
    prompt_len: {dist: lognormal, median: 120, sigma: 0.6, min: 16, max: 600}
    output_len: {dist: lognormal, median: 40, sigma: 0.5, min: 8, max: 200}
    prefix_share: 0.6
    num_prefixes: 6
    prefix_len: 64
"""


def test_a_simulated_run_read_from_its_first_batch_holds_every_block_by_its_requests_holder(tmp_path):
    """Every store of a simulated vLLM, through the wire and the exporter's decoder: each block's tenant and
    adapter as the simulator's journal says (holder of the storing request's owner), none without a tenant."""
    path = tmp_path / "tenants.yml"
    path.write_text(WORKLOAD)
    scenario = override_engine(load_scenario(str(path)), {"num_blocks": 256, "block_size": BLOCK_SIZE})
    engine = ScenarioRun(scenario, FLAVORS["vllm-v1"].reporting, seed=3, record_kv_events=True)
    pool = PoolState(capacity=256)
    tenants: Counter = Counter()
    adapters: Counter = Counter()
    seq = 0
    for now in range(30, 601, 30):
        engine.advance_to(now)
        model = engine.models[0]
        for ts, journal in model.kv_batches:
            for entry in journal:
                if entry[0] == STORED:
                    adapter, salt = holder(entry[3])
                    tenants[tenant_of(salt)] += 1
                    adapters[adapter or "base"] += 1
            batch = decode_payload(seq, sim_events.batch(ts, sim_events.events(journal, BLOCK_SIZE, False), 0), 1 << 24)
            pool.apply(batch.ts, batch.events)
            seq += 1
        model.kv_batches.clear()
    assert len(tenants) == TENANTS and sum(tenants.values()) > 1000
    assert {name: counts[1] for name, counts in pool.tenants.counts.items()} == dict(tenants)
    assert {name: counts[1] for name, counts in pool.adapters.counts.items()} == dict(adapters)
    assert pool.capacity_misses > 0  # evictions and stores again: chains that span them still resolve


def test_the_wire_is_msgpack_of_the_batch():
    events = sim_events.events(JOURNAL[:3], BLOCK_SIZE, signed=False)
    assert msgpack.unpackb(sim_events.batch(2.5, events, 1)) == [2.5, events, 1]


def test_the_simulated_cpu_tier_is_read_as_its_model_counts_it():
    """The offload-tier scenario's stream (the pool's events and its CPU tier's, as vLLM's connector
    announces them) through the wire and the exporter's tiers: the tier stored, evicted and served (loaded back
    into the pool) what the simulator's own counters say."""
    scenario = override_engine(load_scenario("offload-tier"), {"num_blocks": 64, "offload_blocks": 256})
    engine = ScenarioRun(scenario, FLAVORS["vllm-v1"].reporting, seed=3, record_kv_events=True)
    gpu, tiers = PoolState(capacity=64), Tiers()
    seq = 0
    for now in range(30, 181, 30):
        engine.advance_to(now)
        model = engine.models[0]
        for ts, journal in model.kv_batches:
            payload = sim_events.batch(ts, sim_events.events(journal, BLOCK_SIZE, False), 0)
            batch = decode_payload(seq, payload, 1 << 24)
            tiers.apply(gpu, batch.ts, batch.events)
            seq += 1
        model.kv_batches.clear()
    counters, cpu = engine.models[0].counters, tiers.pools["cpu"]
    assert counters.offload_loaded_blocks > 100 and counters.offload_evicted_blocks > 100
    assert (cpu.stored, cpu.evicted) == (counters.offload_stored_blocks, counters.offload_evicted_blocks)
    assert tiers.served == {"cpu": counters.offload_loaded_blocks}
    assert gpu.ignored["other_medium"] == 0
