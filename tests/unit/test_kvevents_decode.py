"""The KV event decoder on messages laid out as the engines' encoders write them (devtools/kvevents_wire.py
says which struct definitions), and the pool state folded from them, against hand-counted arithmetic."""

from __future__ import annotations

import msgpack
import pytest

from kvcache_exporter.blocks import GHOST_FACTOR, PoolState
from kvcache_exporter.contract import DISTANCE_BUCKETS
from kvcache_exporter.sources.kvevents import (CLEARED, REMOVED, SKIP_TOKEN_IDS_FROM, STORED, BlockEvent, DecodeError,
                                               decode_message, decode_payload)
from devtools import kvevents_wire as wire

LIMIT = 1 << 20
KEYS = [1, 2**63 - 1, 2**63, 2**64 - 1]  # both sides of the sign bit
FORMS = {"vllm-v1-early": ("i64",), "sglang-early": ("i64",), "vllm-array": ("u64", "bytes"),
         "vllm-map": ("u64", "bytes"), "vllm-map-envelope": ("u64", "bytes"), "sglang-medium": ("i64",),
         "sglang-map": ("i64",)}


@pytest.mark.parametrize("encoding,form", [(e, f) for e, forms in FORMS.items() for f in forms])
def test_every_encoding_and_hash_form_decodes_to_the_same_events(encoding, form):
    hashes = [wire.hash_as(key, form) for key in KEYS]
    events = [wire.stored(encoding, hashes, parent=hashes[0]), wire.removed(encoding, hashes[1:3]),
              wire.cleared(encoding)]
    batch = decode_message(wire.message(encoding, 41, 1700000000.25, events, dp_rank=3), LIMIT)
    assert batch.seq == 41 and batch.ts == 1700000000.25
    has_rank = encoding not in ("vllm-v1-early", "sglang-early")
    assert batch.dp_rank == (3 if has_rank else None)
    medium = None if encoding in ("vllm-v1-early", "sglang-early") else "GPU"
    # block_size: the wire's 16 tokens per block, in every form (the stream's events_block_size_tokens)
    assert batch.events == [BlockEvent(STORED, KEYS, medium, parent=KEYS[0], block_size=16),
                            BlockEvent(REMOVED, KEYS[1:3], medium),
                            BlockEvent(CLEARED, [])]
    assert (batch.unknown_types, batch.unknown_fields) == (0, 0)


def test_bytes_and_int_forms_of_one_vllm_digest_are_one_key():
    # vLLM's int form is the digest's low 64 bits (int.from_bytes(digest, "big") & (2**64 - 1)).
    digest = bytes(range(100, 132))
    as_int = int.from_bytes(digest, "big") & (2**64 - 1)
    events = [wire.stored("vllm-map", [digest]), wire.stored("vllm-map", [as_int])]
    batch = decode_message(wire.message("vllm-map", 0, 1.0, events), LIMIT)
    assert batch.events[0].hashes == batch.events[1].hashes == [as_int]


def test_sglang_salted_store_and_other_media_and_groups_are_read():
    events = [wire.stored("sglang-medium", [-5], salt="tenant-a"), wire.stored("sglang-map", [-6], salt="t"),
              wire.stored("vllm-map", [7], medium="CPU"), wire.removed("vllm-array", [8], group_idx=1)]
    batch = decode_message(wire.message("vllm-map", 0, 1.0, events), LIMIT)
    assert [(e.kind, e.hashes, e.medium, e.group_idx) for e in batch.events] == [
        (STORED, [2**64 - 5], "GPU", None), (STORED, [2**64 - 6], "GPU", None), (STORED, [7], "CPU", None),
        (REMOVED, [8], "GPU", 1)]
    # The salted array carries one element past the fields this decoder reads (its metadata map).
    assert batch.unknown_fields == 0


def test_unknown_types_and_fields_are_skipped_and_counted():
    events = [["BlockTouched", [1]], {"type": "Heartbeat"},
              {"type": "BlockStored", "block_hashes": [9], "origin": "NEW", "medium": "GPU"},
              ["BlockRemoved", [9], "GPU", 0, "extra"], ["AllBlocksCleared", 1]]
    batch = decode_message([b"t", (5).to_bytes(8, "big"), msgpack.packb([2.0, events, 0])], LIMIT)
    assert (batch.unknown_types, batch.unknown_fields) == (2, 3)
    assert [(e.kind, e.hashes) for e in batch.events] == [(STORED, [9]), (REMOVED, [9]), (CLEARED, [])]


@pytest.mark.parametrize("frames", [
    [b"", (1).to_bytes(8, "big")],  # two frames
    [b"", (1).to_bytes(4, "big"), msgpack.packb([1.0, []])],  # short sequence frame
    [b"", (1).to_bytes(8, "big"), b"\xc1"],  # a byte msgpack never uses
    [b"", (1).to_bytes(8, "big"), msgpack.packb([1.0, []]) + b"x"],  # trailing bytes
    [b"", (1).to_bytes(8, "big"), msgpack.packb("a string")],
    [b"", (1).to_bytes(8, "big"), msgpack.packb(["ts", []])],
    [b"", (1).to_bytes(8, "big"), msgpack.packb([1.0, [["BlockStored", [1.5]]]])],  # a float hash
    [b"", (1).to_bytes(8, "big"), msgpack.packb([1.0, [["BlockStored", [True]]]])],
    [b"", (1).to_bytes(8, "big"), msgpack.packb([1.0, [["BlockStored", 7]]])],
    [b"", (1).to_bytes(8, "big"), msgpack.packb([1.0, [[["BlockStored"], [1]]]])],  # unhashable tag
    [b"", (1).to_bytes(8, "big"), msgpack.packb([1.0, [{"type": "BlockRemoved", "block_hashes": [1],
                                                         "medium": 3}]])],
    [b"", (1).to_bytes(8, "big"), msgpack.packb([1.0, [7]])],
    [b"", (1).to_bytes(8, "big"), msgpack.packb([1.0, [], "rank"])],
    [b"", (1).to_bytes(8, "big"), msgpack.packb([1.0, [["BlockStored", [1], None, [], 16, None, "GPU", None,
                                                         None, "group"]]])],
])
def test_malformed_messages_raise_decode_error(frames):
    with pytest.raises(DecodeError):
        decode_message(frames, LIMIT)


def test_a_payload_above_the_limit_is_refused_before_it_is_read():
    payload = wire.batch("vllm-map", 1.0, [wire.stored("vllm-map", list(range(1000)))])
    assert decode_payload(0, payload, len(payload)).events[0].hashes == list(range(1000))
    with pytest.raises(DecodeError, match="above the limit"):
        decode_payload(0, payload, len(payload) - 1)


@pytest.mark.parametrize("encoding", wire.ENCODINGS)
def test_a_batch_with_long_token_lists_is_read_without_them_to_the_same_events(encoding):
    """vLLM sends every stored block's token ids: with long lists (1,024 a block here, the builder's ids are
    small numbers of two bytes) the batch is read field by field with them skipped, and decodes to what the same
    batch at 16 a block (read whole) does."""
    def payload(block_size: int) -> bytes:
        events = [wire.stored(encoding, [11, 12], parent=10, block_size=block_size, salt="s", lora_name="a"),
                  wire.removed(encoding, [11]), wire.stored(encoding, [13], block_size=block_size),
                  wire.cleared(encoding)]
        return wire.batch(encoding, 5.0, events, dp_rank=1)

    short, long = payload(16), payload(1024)
    assert len(short) < 4 * SKIP_TOKEN_IDS_FROM <= len(long)  # four events: one way of reading each
    expected = decode_payload(0, short, LIMIT)
    for event in expected.events:  # the same events, each store naming its own block size
        event.block_size = 1024 if event.block_size else event.block_size
    assert decode_payload(0, long, LIMIT) == expected
    assert decode_payload(0, long, LIMIT).events[0].hashes == [11, 12]
    for broken in (long[:-1], long + b"x"):  # cut short, or bytes after the batch
        with pytest.raises(DecodeError):
            decode_payload(0, broken, LIMIT)


# -- pool state ------------------------------------------------------------------------------------

def stored(*keys):
    return BlockEvent(STORED, list(keys))


def prompt(*keys):
    """A request's store whose prompt goes on after `keys`: a block of its own (a new hash) ends it, so that
    every one of `keys` is a block a larger pool would have served (the last block of a store is not,
    test_the_last_block_of_a_store_is_not_a_capacity_miss)."""
    return BlockEvent(STORED, [*keys, 10_000 + keys[-1]])


def removed(*keys):
    return BlockEvent(REMOVED, list(keys))


def test_capacity_miss_distance_counts_the_evictions_in_between():
    pool = PoolState(capacity=10)
    pool.apply(0.0, [stored(*range(1, 11))])
    pool.apply(5.0, [removed(1)])  # ordinal 0
    pool.apply(6.0, [removed(*range(2, 6))])  # ordinals 1..4
    pool.apply(6.5, [stored(*range(11, 16))])  # the request those evictions made room for
    pool.apply(7.0, [prompt(1)])  # 4 evictions since 1's: distance 0.4
    pool.apply(8.0, [prompt(2)])  # 3 since 2's: 0.3
    pool.apply(9.0, [prompt(99)])  # never seen: not a capacity miss
    assert (pool.stored, pool.evicted, pool.capacity_misses) == (21, 5, 2)
    assert pool.distance.cumulative() == [(b, 0 if b < 0.5 else 2) for b in DISTANCE_BUCKETS] + [
        (float("inf"), 2)]
    assert pool.distance.sum == pytest.approx(0.7)
    # Residency: 1 lived 0..5 s, 2..5 lived 0..6 s.
    assert pool.residency.count == 5 and pool.residency.sum == pytest.approx(5 + 4 * 6)
    assert pool.residency.cumulative()[1] == (5.0, 1)


def test_a_block_that_came_back_no_longer_lies_between():
    # LRU stack: a, b, c leave the pool in that order; b comes back (it goes on top of the pool), so a lies
    # below c only: a pool 2 blocks larger would have kept a (depth 1 < 2).
    pool = PoolState(capacity=2)
    pool.apply(0.0, [stored(10, 11, 12), removed(10), removed(11), removed(12), stored(20, 21, 22),
                     prompt(11), prompt(10)])
    assert pool.capacity_misses == 2
    assert pool.distance.sum == pytest.approx((1 + 1) / 2)  # b: c after it; a: b and c after it, b came back


def test_the_ring_of_marks_survives_a_capacity_change_and_wraps():
    pool = PoolState(capacity=2)
    pool.apply(0.0, [stored(*range(100, 120)), removed(*range(100, 120))])  # positions 0..19, window 8
    pool.apply(0.5, [stored(*range(400, 420))])
    pool.apply(1.0, [prompt(118)])  # depth 1 (119)
    pool.set_capacity(3)  # a list of 12 now; the list of 8 had dropped 100..111 already
    assert set(pool.ghost) == set(range(112, 118)) | {119}
    pool.apply(2.0, [stored(200), removed(200), stored(201), prompt(113)])  # 114..117, 119, 200 after it: depth 6
    assert pool.distance.sum == pytest.approx(1 / 2 + 6 / 3)


def test_duplicate_copies_are_reference_counted():
    pool = PoolState(capacity=4)
    pool.apply(0.0, [stored(7, 8), stored(7, 8)])  # vLLM can cache the same content twice (two requests at once)
    pool.apply(1.0, [removed(7)])  # one physical copy reallocated: the content is still resident
    assert 7 in pool.resident and 7 not in pool.ghost and pool.evicted == 1
    pool.apply(2.0, [removed(7), stored(9)])
    # the last copy after the first, which keeps its place below the pool: a larger pool would still hold it
    assert 7 not in pool.resident and pool.ghost[7] == 1 and pool.evicted == 2
    pool.apply(3.0, [prompt(7)])
    assert pool.capacity_misses == 1 and pool.distance.sum == 0.0
    assert pool.residency.count == 1 and pool.residency.sum == 2.0  # stored at 0, last copy gone at 2


def test_the_last_block_of_a_store_is_not_a_capacity_miss():
    """The engines never count the block holding a prompt's last token as a hit (vLLM's lookup stops at the
    prompt length minus one): a request stores it last, and stored again after an eviction it would not have
    been a hit in a larger pool either. A block the next turn of a conversation stores among the rest was a
    block its prompt went on after: one a larger pool would have served."""
    pool = PoolState(capacity=4)
    pool.apply(0.0, [stored(1, 2, 3)])  # a prompt of 3 whole blocks
    pool.apply(1.0, [removed(3), stored(50)])  # its last block, freed first, evicted for another request's
    pool.apply(2.0, [stored(3)])  # the prompt again: 1, 2 hit, 3 computed again
    pool.apply(3.0, [stored(3)])  # and again, 3 still cached: computed again, a second copy
    assert (pool.capacity_misses, pool.recomputed) == (0, 1)
    pool.apply(4.0, [removed(3), removed(3), removed(2), removed(1), stored(51, 52, 53, 54)])
    pool.apply(5.0, [stored(1, 2, 3)])  # again after all of it was evicted
    assert (pool.capacity_misses, pool.recomputed, pool.distance.count) == (2, 2, 2)
    pool.apply(6.0, [removed(3), stored(55), stored(3, 4)])  # the next turn: its prompt goes on after 3
    assert (pool.capacity_misses, pool.recomputed, pool.distance.count) == (3, 2, 3)


def test_a_copy_no_lookup_touches_again_keeps_its_place_below_the_pool():
    """A larger pool still holds the old copy of a block computed again and a copy evicted while another stays
    cached, where they were (no lookup moves them up): the blocks evicted before them lie that much deeper."""
    pool = PoolState(capacity=10)
    pool.apply(0.0, [stored(1, 2, 3), stored(3), stored(7, 8)])  # 3 twice: its prompt came back whole
    pool.apply(1.0, [removed(1), removed(3), removed(8), removed(3), stored(60, 61, 62, 63)])  # 1, a copy of 3,
    # 8, the last 3, for another request's blocks
    pool.apply(2.0, [stored(8)])  # 8, a last block again: its old copy stays below the pool
    pool.apply(3.0, [prompt(1)])  # after 1: the first copy of 3, 8's old copy and 3: depth 3
    assert (pool.capacity_misses, pool.recomputed) == (1, 1)
    assert pool.distance.sum == pytest.approx(3 / 10)


def test_clear_forgets_residents_and_ghosts_but_keeps_the_counters():
    pool = PoolState(capacity=4)
    pool.apply(0.0, [stored(1, 2), removed(1), BlockEvent(CLEARED, []), stored(1)])
    assert pool.capacity_misses == 0 and pool.resident == {1: 0.0} and pool.ghost == {}
    assert (pool.stored, pool.evicted) == (3, 1)


def test_other_media_and_groups_leave_the_gpu_pool_alone():
    pool = PoolState(capacity=4)
    pool.apply(0.0, [BlockEvent(STORED, [1, 2], "CPU"), BlockEvent(STORED, [3], "CPU_PINNED"),
                     BlockEvent(STORED, [4], "GPU", 1), BlockEvent(STORED, [5], "GPU", 0), stored(6)])
    assert pool.ignored == {"other_medium": 3, "other_group": 1}
    assert set(pool.resident) == {5, 6} and pool.stored == 2


def test_ghost_list_is_bounded_at_a_multiple_of_capacity():
    capacity = 8
    pool = PoolState(capacity=capacity)
    keys = list(range(1000))
    pool.apply(0.0, [stored(*keys), removed(*keys)])
    assert len(pool.ghost) == GHOST_FACTOR * capacity
    assert set(pool.ghost) == set(keys[-GHOST_FACTOR * capacity:])
    pool.apply(1.0, [prompt(keys[0]), prompt(keys[-1])])  # the first fell off the list, the last did not
    assert pool.capacity_misses == 1
    # A hash evicted, re-stored and evicted again keeps its newest ordinal when the old one is trimmed.
    pool.apply(2.0, [removed(keys[-1])])
    pool.apply(3.0, [stored(*range(2000, 2000 + 4 * capacity)), removed(*range(2000, 2000 + 4 * capacity - 1))])
    assert keys[-1] in pool.ghost and pool.ghost[keys[-1]] == 1000
