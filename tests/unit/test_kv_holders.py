"""Who holds the KV: per-adapter and per-tenant counts folded from decoded event streams, against
hand-counted arithmetic; tenants only as keyed hashes; the top N plus `other` under 10,000 salts."""

from __future__ import annotations

from kvcache_exporter import exposition
from kvcache_exporter.blocks import OTHER, RESIDENT, STORED_BLOCKS, HolderCounts, PoolState
from kvcache_exporter.runtime.subscriber import Subscribers, _holder_series
from kvcache_exporter.snapshot import RankValues
from kvcache_exporter.sources.kvevents import STORED, BlockEvent, decode_message, tenant_of
from devtools import kvevents_wire as wire

LIMIT = 1 << 20


def holders(pool: PoolState, top: int = 10) -> dict[str, dict[str, float]]:
    return {family: {labels[0]: value for labels, value in series.items()}
            for family, series in _holder_series(pool, top).items()}


def test_each_engines_form_names_the_adapter_and_the_tenant_hash():
    events = [wire.stored("vllm-map", [1, 2], lora_name="sql", salt="acme"),
              wire.stored("vllm-array", [3], lora_name="chat", salt="beta"),
              wire.stored("sglang-map", [-4], salt="acme", lora_name="sql"),
              wire.stored("sglang-medium", [-5], salt="gamma"),
              wire.stored("vllm-v1-early", [6]),
              wire.stored("vllm-map", [7], parent=2, lora_name="sql")]
    batch = decode_message(wire.message("vllm-map", 0, 1.0, events), LIMIT)
    assert [(e.adapter, e.tenant, e.parent) for e in batch.events] == [
        ("sql", tenant_of("acme"), None), ("chat", tenant_of("beta"), None), ("sql", tenant_of("acme"), None),
        (None, tenant_of("gamma"), None), (None, None, None), ("sql", None, 2)]
    assert batch.unknown_fields == 0


def test_tenants_are_keyed_hashes_that_never_show_the_salt():
    label = tenant_of("acme")
    assert len(label) == 12 and int(label, 16) >= 0 and "acme" not in label
    assert tenant_of("acme") == label and tenant_of(b"acme") == label and tenant_of("acme2") != label
    assert tenant_of(None) is None and tenant_of("") is None
    pool = PoolState(capacity=8)
    pool.apply(0.0, decode_message(wire.message("vllm-map", 0, 1.0, [wire.stored("vllm-map", [1], salt="acme")]),
                                   LIMIT).events)
    values = RankValues({}, {}, {}, _holder_series(pool, 10))
    text = b"".join(exposition.render_pool({"target": "t"}, values, exposition.Prefixes()).status.values())
    assert f'tenant="{label}"'.encode() in text and b"acme" not in text


def test_counts_per_adapter_and_tenant_on_a_hand_counted_sequence():
    acme, beta = tenant_of("acme"), tenant_of("beta")
    pool = PoolState(capacity=4)
    pool.apply(0.0, [BlockEvent(STORED, [1, 2], adapter="sql", tenant=acme)])
    pool.apply(1.0, [BlockEvent(STORED, [3], parent=2, adapter="sql")])  # no salt: its parent's tenant
    pool.apply(2.0, [BlockEvent(STORED, [4], tenant=beta)])  # no adapter: the base model
    pool.apply(3.0, [BlockEvent("BlockRemoved", [1, 3]), BlockEvent(STORED, [9])])  # no salt and no parent
    # 1 back after its eviction: a miss; 2, cached, computed again after it (the lookup stopped at 1)
    pool.apply(4.0, [BlockEvent(STORED, [1, 2], adapter="sql", tenant=acme)])
    pool.apply(5.0, [BlockEvent(STORED, [4], tenant=beta)])  # a second copy of block 4
    pool.apply(6.0, [BlockEvent("BlockRemoved", [4])])  # one copy goes, the other stays resident
    assert (pool.stored, pool.evicted, pool.capacity_misses) == (8, 3, 1)
    got = holders(pool)
    # stored: sql 2+1+2, base 1+1+1; resident: sql {1,2}, base {4,9}; evicted: sql 1 and 3, base a copy of 4
    assert got["adapter_blocks_stored_total"] == {"sql": 5.0, "base": 3.0}
    assert got["adapter_blocks_resident"] == {"sql": 2.0, "base": 2.0}
    assert got["adapter_blocks_evicted_total"] == {"sql": 2.0, "base": 1.0}
    assert got["adapter_capacity_miss_blocks_total"] == {"sql": 1.0, "base": 0.0}
    assert got["tenant_blocks_stored_total"] == {acme: 5.0, beta: 2.0, "none": 1.0}
    assert got["tenant_blocks_resident"] == {acme: 2.0, beta: 1.0, "none": 1.0}
    assert got["tenant_blocks_evicted_total"] == {acme: 2.0, beta: 1.0, "none": 0.0}
    assert got["tenant_capacity_miss_blocks_total"] == {acme: 1.0, beta: 0.0, "none": 0.0}
    assert got["events_holders_folded"] == {"adapter": 0.0, "tenant": 0.0}
    assert sum(got["tenant_blocks_resident"].values()) == len(pool.resident) == 4


def test_a_clear_empties_residency_and_keeps_the_counters():
    pool = PoolState(capacity=4)
    pool.apply(0.0, [BlockEvent(STORED, [1, 2], adapter="sql")])
    pool.apply(1.0, [BlockEvent("AllBlocksCleared", [])])
    got = holders(pool)
    assert got["adapter_blocks_resident"] == {"sql": 0.0}
    assert got["adapter_blocks_stored_total"] == {"sql": 2.0}


def test_ten_thousand_salts_show_the_top_n_and_other_with_the_rest_counted():
    pool = PoolState(capacity=65536)
    key = 0
    for tenant in range(10_000):
        blocks = 100 + tenant if tenant < 15 else 1  # tenants 0..14 hold 100..114 blocks, the rest one each
        pool.apply(float(tenant), [BlockEvent(STORED, list(range(key, key + blocks)), tenant=tenant_of(f"t{tenant}"))])
        key += blocks
    got = holders(pool, top=10)
    resident = got["tenant_blocks_resident"]
    assert len(resident) == 11  # N + other
    assert sorted(v for k, v in resident.items() if k != "other") == [float(b) for b in range(105, 115)]
    assert resident["other"] == sum(range(100, 105)) + 9_985  # tenants 0..4 and the 9,985 single-block ones
    assert got["events_holders_folded"]["tenant"] == 10_000 - 10
    assert sum(resident.values()) == len(pool.resident)
    for family in ("tenant_blocks_stored_total", "tenant_blocks_evicted_total", "tenant_capacity_miss_blocks_total"):
        assert got[family].keys() == resident.keys()
    values = RankValues({}, {}, {}, _holder_series(pool, 10))
    text = exposition.render_pool({"target": "t"}, values, exposition.Prefixes()).status
    assert text["tenant_blocks_resident"].count(b"\n") == 11


def test_holders_that_left_the_pool_are_retired_into_other_which_keeps_their_counts():
    pool = PoolState(capacity=8)
    pool.apply(0.0, [BlockEvent(STORED, [1, 2], tenant="a"), BlockEvent(STORED, [3], tenant="b")])
    pool.apply(1.0, [BlockEvent("BlockRemoved", [3]), BlockEvent(STORED, [2], tenant="a")])  # 2 computed again
    got = holders(pool, top=1)  # b holds nothing and ranks below a: retired into other
    assert got["tenant_blocks_stored_total"] == {"a": 3.0, "other": 1.0}
    assert got["tenant_blocks_evicted_total"] == {"a": 0.0, "other": 1.0}
    assert got["events_holders_folded"]["tenant"] == 0 and "b" not in pool.tenants.counts
    pool.apply(2.0, [BlockEvent(STORED, [3, 4], tenant="b")])  # b again: 3 a capacity miss, counted from 0
    got = holders(pool, top=1)
    assert got["tenant_blocks_resident"] == {"a": 2.0, "other": 2.0}
    assert got["tenant_blocks_stored_total"] == {"a": 3.0, "other": 3.0}  # never down: retired 1 + live 2
    assert got["tenant_capacity_miss_blocks_total"] == {"a": 0.0, "other": 1.0}
    assert got["events_holders_folded"]["tenant"] == 1


def test_reranking_keeps_every_shown_counter_from_going_down():
    """A holder that climbs into the top starts its own series and leaves `other` as it was; one that drops out takes
    nothing with it: each counter series only grows, and the series add up to every block stored."""
    counts = HolderCounts()
    counts.add("a", RESIDENT, 5)
    counts.add("a", STORED_BLOCKS, 5)
    counts.add("b", RESIDENT, 1)
    counts.add("b", STORED_BLOCKS, 1)
    first, _ = counts.top(1)
    assert first == {"a": [5, 5, 0, 0], OTHER: [1, 1, 0, 0]}
    # b grows past a: b's series starts with the 8 stored since the last render; `other` keeps b's first block.
    counts.add("b", RESIDENT, 8)
    counts.add("b", STORED_BLOCKS, 8)
    counts.add("a", STORED_BLOCKS, 2)
    second, folded = counts.top(1)
    assert second == {"b": [9, 8, 0, 0], OTHER: [5, 1 + 2, 0, 0]}
    assert folded == 1
    third, _ = counts.top(1)
    assert third == second
    total_stored = 5 + 1 + 8 + 2
    assert sum(series[STORED_BLOCKS] for series in second.values()) + 5 == total_stored  # a's 5 stay in a's old series


def test_the_streams_are_rendered_once_a_poll_interval_however_often_metrics_is_scraped():
    """Ranking the holders (thousands of tenants) belongs to the poll's cadence, not to every scrape: scrapes
    within an interval of the last render join the same text; the first one after it renders anew."""
    class CountingStream:
        def __init__(self, name: str):
            self.target = type("Target", (), {"name": name})()
            self.rank = self.pool_rank = 0
            self.renders = 0

        def render(self, rank: int):
            self.renders += 1
            return (self.target.name, rank, self.renders)

    subscribers = Subscribers()
    subscribers.streams = {("a",): CountingStream("a"), ("b",): CountingStream("b")}
    seen = [subscribers.render(at, 5.0) for at in (100.0, 101.0, 104.9, 105.0, 107.0)]
    assert [stream.renders for stream in subscribers.streams.values()] == [2, 2]
    assert seen[0] == seen[1] == seen[2] == [("a", 0, 1), ("b", 0, 1)]
    assert seen[3] == seen[4] == [("a", 0, 2), ("b", 0, 2)]


def test_vllm_0_32s_untagged_extra_keys_name_the_tenant():
    """vLLM 0.32 publishes extra_keys untagged (vllm/v1/core/kv_cache_utils.py, to_event_extra_keys): per block
    the LoRA name, (identifier, offset) pairs of multi-modal inputs, the salt on the request's first block, prompt
    embeds digests as bytes. Seen on the real engine: a salted request's store carried [["acme"], None, None]."""
    import msgpack

    def store(hashes, lora_id, lora_name, extra_keys):
        return ["BlockStored", hashes, None, list(range(32 * len(hashes))), 32, lora_id, "GPU", lora_name,
                extra_keys, 0, None]

    events = [store([1, 2, 3], None, None, [["acme"], None, None]),
              store([4, 5], 1, "sql", [["sql", "beta"], ["sql"]]),
              store([6], 1, "sql", [["sql"]]),  # an adapter, no salt
              store([7], None, None, [[["mm-digest", 0], b"\x01" * 32]]),  # multi-modal and prompt embeds only
              store([8], None, None, None)]
    frames = [b"", (0).to_bytes(8, "big"), msgpack.packb([1.0, events, 0])]
    batch = decode_message(frames, LIMIT)
    assert [(e.adapter, e.tenant) for e in batch.events] == [
        (None, tenant_of("acme")), ("sql", tenant_of("beta")), ("sql", None), (None, None), (None, None)]
    assert batch.unknown_fields == 0
