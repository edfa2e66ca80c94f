"""The what-if on a public production trace (bench/whatif_trace.py): the first requests of Mooncake's FAST'25
synthetic trace served by an LRU pool of C blocks as vLLM's would serve them, its events through the exporter's
PoolState, against the same LRU with twice the blocks.

What the projection promises (docs/kv-events.md, "How to read the distance histogram"): a capacity miss at
distance d lay d places below the pool, so a pool of more than C + d blocks keeps it; the bucket le = 1 counts
d <= C, so what it keeps lies between the hits of a pool of 2C blocks and those of one of 2C + 1, where one
request runs at a time. "Blocks no pool would have served" names where it falls short: a prompt that ends
inside a block, whose last whole block (the last of its store) is stored again after an eviction, is taken for
one no pool serves: at most one block per such request."""

from __future__ import annotations

from bench.whatif_trace import BLOCK_TOKENS, Request, load, serve, whole_blocks
from kvcache_exporter.blocks import PoolState
from kvcache_exporter.sources.kvevents import STORED

CUT = 1500  # requests
C = 4000  # blocks


class Recorder:
    """The events of each request, on their way to the pool."""

    def __init__(self, pool: PoolState):
        self.pool = pool
        self.requests: list[list] = []

    def apply(self, ts, events):
        self.requests.append(events)
        self.pool.apply(ts, events)


def kept_at_x2(requests: list[Request]) -> tuple[int, int, list[list]]:
    """(C's hit blocks, the capacity-miss blocks of the bucket le = 1, each request's events)."""
    pool = PoolState(capacity=C)
    recorder = Recorder(pool)
    hits = serve(requests, C, recorder)
    return hits, dict(pool.distance.cumulative())[1.0], recorder.requests


def test_on_prompts_of_whole_blocks_the_projection_is_the_exact_lru_of_twice_the_blocks():
    requests = whole_blocks(load("synthetic", CUT))
    hits, kept, _ = kept_at_x2(requests)
    exact, one_more = serve(requests, 2 * C), serve(requests, 2 * C + 1)
    assert exact > hits  # the larger pool gains: there is something to predict
    assert exact <= hits + kept <= one_more, (hits, kept, exact, one_more)


def test_on_the_trace_as_published_the_projection_falls_short_by_last_whole_blocks_at_most():
    requests = load("synthetic", CUT)
    hits, kept, events = kept_at_x2(requests)
    exact, one_more = serve(requests, 2 * C), serve(requests, 2 * C + 1)
    # Requests whose prompt ends inside a block and whose last whole block was cached before, so stored again
    # after its eviction (a block past the lookup's cap, the only other store of a cached hash, needs a prompt
    # that ends on a boundary).
    seen: set[int] = set()
    short = 0
    for request, batch in zip(requests, events):
        for event in batch:
            if event.kind != STORED:
                continue
            short += request.tokens % BLOCK_TOKENS != 0 and event.hashes[-1] in seen
            seen.update(event.hashes)
    assert exact > hits
    assert short > 0  # the rule's shortfall is there to bound
    assert exact - short <= hits + kept <= one_more, (hits, kept, exact, short, one_more)
