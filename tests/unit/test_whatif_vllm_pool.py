"""The what-if against a replica of vLLM's block pool (vllm/v1/core: KVCacheManager.get_computed_blocks caps a
lookup at the prompt length minus one token and takes whole blocks; BlockPool hands out the free queue's head,
evicting its cached block, and caches a request's computed whole blocks in one BlockStored; a finished request's
blocks go back to the queue's tail last block first). Requests one at a time, of whole blocks, one output token:
tests/real/test_vllm_whatif.py's workload shapes and seeds, whose hit ratios this replica gives as the real
engines' pages did (docs/kv-events.md). The pool of C blocks' events go through the exporter's PoolState; its projection
for pools 1.5 and 2 times as large is their replica's hit ratio."""

from __future__ import annotations

import random
from collections import OrderedDict

import pytest

from kvcache_exporter.blocks import PoolState
from kvcache_exporter.sources.kvevents import REMOVED, STORED, BlockEvent

BLOCK = 32
SMALL = 63  # usable blocks (vLLM's --num-gpu-blocks-override 64, its null block apart)
LARGER = {1.5: 95, 2.0: 127}


def serve(requests: list[list[tuple]], usable: int) -> tuple[int, int, list[BlockEvent]]:
    """(hit blocks, looked-up blocks, the events) of a pool of `usable` blocks serving `requests`, each the
    content of its whole blocks."""
    free: OrderedDict[int, None] = OrderedDict((block, None) for block in range(usable))
    content: dict[int, tuple] = {}  # block -> the hash it is cached under
    cached: dict[tuple, OrderedDict[int, None]] = {}  # hash -> its blocks, the oldest copy first
    events: list[BlockEvent] = []
    hits = queried = 0
    for blocks in requests:
        hashes = [tuple(blocks[:index + 1]) for index in range(len(blocks))]
        hit = []
        for key in hashes[:(len(blocks) * BLOCK - 1) // BLOCK]:  # the lookup stops before the last token
            if key not in cached:
                break
            hit.append(next(iter(cached[key])))
        for block in hit:
            free.pop(block, None)
        new = []
        for _ in hashes[len(hit):]:
            block, _ = free.popitem(last=False)
            key = content.pop(block, None)
            if key is not None:
                del cached[key][block]
                if not cached[key]:
                    del cached[key]
                events.append(BlockEvent(REMOVED, [key]))
            new.append(block)
        for block, key in zip(new, hashes[len(hit):]):
            content[block] = key
            cached.setdefault(key, OrderedDict())[block] = None
        events.append(BlockEvent(STORED, list(hashes[len(hit):])))
        for block in reversed(hit + new):
            free[block] = None
        hits += len(hit)
        queried += len(blocks)
    return hits, queried, events


def prefixes_and_suffixes(prefixes: int, count: int, seed: int) -> list[list[tuple]]:
    rng = random.Random(seed)
    return [[("prefix", seed, p, index) for index in range(3)] + [("suffix", seed, n)]
            for n, p in enumerate(rng.randrange(prefixes) for _ in range(count))]


def recurring_prompts(prompts: int, count: int, seed: int) -> list[list[tuple]]:
    rng = random.Random(seed)
    return [[("prompt", seed, p, index) for index in range(4)] for p in (rng.randrange(prompts) for _ in range(count))]


def conversations(count: int, turns: int, seed: int) -> list[list[tuple]]:
    """Turns of 2, 3, ... blocks: each the previous turn and a block more."""
    order = [conversation for conversation in range(count) for _ in range(turns)]
    random.Random(seed).shuffle(order)
    so_far = [[("turn", seed, conversation, index) for index in range(2)] for conversation in range(count)]
    requests = []
    for n, conversation in enumerate(order):
        requests.append(list(so_far[conversation]))
        so_far[conversation].append(("turn", seed, conversation, 2 + n))
    return requests


def mix(seeds: tuple[int, int, int], seed: int) -> list[list[tuple]]:
    lists = [prefixes_and_suffixes(8, 40, seeds[0]), recurring_prompts(8, 40, seeds[1]), conversations(5, 8, seeds[2])]
    order = [which for which, requests in enumerate(lists) for _ in requests]
    random.Random(seed).shuffle(order)
    taken = [iter(requests) for requests in lists]
    return [next(taken[which]) for which in order]


# The real test's shapes and seeds (devtools/vllm_engine.py draws with random.Random(seed) the same way), and
# the hit ratios the real engines' pages gave for them (C, 1.5C, 2C; docs/kv-events.md).
SHAPES = {"prefixes-and-suffixes": (lambda: prefixes_and_suffixes(24, 120, 29), (0.3750, 0.4875, 0.5813)),
          "recurring-prompts": (lambda: recurring_prompts(24, 120, 31), (0.3937, 0.5292, 0.5875)),
          "conversations": (lambda: conversations(16, 8, 37), (0.5199, 0.6918, 0.7827)),
          "mix": (lambda: mix((41, 43, 47), 53), (0.4852, 0.6574, 0.6852))}


def test_the_replica_gives_the_real_engines_hit_ratios():
    for shape, (make, pages) in SHAPES.items():
        requests = make()
        ratios = [hits / queried for hits, queried, _ in (serve(requests, usable) for usable in (SMALL, *LARGER.values()))]
        assert [round(ratio, 4) for ratio in ratios] == list(pages), shape


@pytest.mark.parametrize("shape", list(SHAPES))
def test_the_projection_is_the_larger_replicas_hit_ratio(shape):
    requests = SHAPES[shape][0]()
    hits, queried, events = serve(requests, SMALL)
    pool = PoolState(capacity=SMALL)
    pool.apply(0.0, events)
    kept = dict(pool.distance.cumulative())
    for factor, usable in LARGER.items():
        larger_hits, _, _ = serve(requests, usable)
        assert larger_hits > hits  # the larger pool gains: there is something to predict
        assert hits + kept[factor - 1] == larger_hits, (factor, hits, kept[factor - 1], larger_hits)
