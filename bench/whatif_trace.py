"""What more KV would buy, on a public production trace: the exporter's projection beside an exact LRU simulation.

    python -m bench.whatif_trace [--requests N]

Mooncake's FAST'25 traces (bench/traces/README.md): each request is its prompt's length and the hashes of its
512-token blocks, as a prefix chain. A pool of C blocks serves them one at a time, as vLLM's would: the lookup
takes the leading blocks cached, capped at the prompt length minus one token (whole blocks only); the blocks it
did not find are computed, evicting the least recently used blocks that no running request holds, and cached in
one BlockStored (the prompt's whole blocks only); the request's blocks then go back last block first, so its
first block is the most recently used. The pool's BlockRemoved and BlockStored go through the exporter's
PoolState (exporter/blocks.py); its projection for a pool `factor` times as large is what
kvcache:prefix_cache_hit_ratio:projected computes: C's hit tokens plus the capacity-miss blocks of the distance
bucket le = factor - 1 times 512, over the prompt tokens looked up. Beside it, the same LRU with C x factor
blocks gives the exact hit ratio. Output tokens and the prompt's partial last block take no room here (vLLM
caches neither under the trace's hashes). The last column replays the same blocks with each prompt cut to its
whole blocks: the difference the exporter's rule for a store's last block makes on prompts that end inside one.
"""

from __future__ import annotations

import argparse
import gzip
import json
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from kvcache_exporter.blocks import PoolState
from kvcache_exporter.contract import WHAT_IF_FACTORS
from kvcache_exporter.sources.kvevents import REMOVED, STORED, BlockEvent

TRACES = Path(__file__).parent / "traces"
BLOCK_TOKENS = 512  # the traces' block size
# Pools from a few requests' worth (the longest prompt has 373 whole blocks) to most of a trace's distinct blocks.
CAPACITIES = {"conversation": (2_000, 8_000, 32_000), "synthetic": (1_000, 4_000, 10_000)}


@dataclass(slots=True)
class Request:
    ts: float  # seconds from the trace's start
    tokens: int  # prompt tokens
    blocks: list[int]  # the hashes of its whole blocks


def load(name: str, limit: int | None = None) -> list[Request]:
    """The first `limit` requests (all by default) of bench/traces/<name>_trace.jsonl.gz."""
    requests = []
    with gzip.open(TRACES / f"{name}_trace.jsonl.gz", "rt") as lines:
        for line in lines:
            if limit is not None and len(requests) == limit:
                break
            row = json.loads(line)
            tokens = row["input_length"]
            requests.append(Request(row["timestamp"] / 1000, tokens, row["hash_ids"][:tokens // BLOCK_TOKENS]))
    return requests


def serve(requests: list[Request], capacity: int, pool: PoolState | None = None) -> int:
    """Hit blocks of an LRU pool of `capacity` blocks serving `requests` one at a time (the module's docstring);
    its events go to `pool` if given."""
    free: OrderedDict[int, int] = OrderedDict()  # the cached blocks no request holds -> their hash, the LRU first
    copies: dict[int, list[int]] = {}  # hash -> the blocks holding it, the oldest first
    allocated = hits = 0  # blocks ever handed out: the pool fills before it evicts
    for request in requests:
        blocks = request.blocks
        if len(blocks) > capacity:
            raise ValueError(f"a request of {len(blocks)} blocks does not fit a pool of {capacity}")
        lookup = min(len(blocks), (request.tokens - 1) // BLOCK_TOKENS)
        held: list[int] = []  # the request's blocks, in its order: not evictable while it runs
        while len(held) < lookup and blocks[len(held)] in copies:
            held.append(copies[blocks[len(held)]][0])
            del free[held[-1]]
        hit = len(held)
        hits += hit
        evicted = []
        for key in blocks[hit:]:  # computed, each into a block of its own (a second copy if one is cached)
            if allocated < capacity:
                block, allocated = allocated, allocated + 1
            else:
                block, old = free.popitem(last=False)
                copies[old].remove(block)
                if not copies[old]:
                    del copies[old]
                evicted.append(old)
            copies.setdefault(key, []).append(block)
            held.append(block)
        for block, key in zip(reversed(held), reversed(blocks)):  # freed last block first
            free[block] = key
        if pool is not None:
            events = [BlockEvent(REMOVED, evicted)] if evicted else []
            if hit < len(blocks):
                events.append(BlockEvent(STORED, blocks[hit:]))
            pool.apply(request.ts, events)
    return hits


def compare(requests: list[Request], capacity: int, factors=WHAT_IF_FACTORS) -> list[tuple[float, float, float]]:
    """(factor, the exact hit ratio of an LRU pool of capacity x factor blocks, the exporter's projection from the
    pool of `capacity` blocks' events) per factor, after (1, the pool's own hit ratio twice)."""
    queried = sum(request.tokens for request in requests)
    pool = PoolState(capacity=capacity)
    hits = serve(requests, capacity, pool) * BLOCK_TOKENS
    kept = dict(pool.distance.cumulative())
    rows = [(1.0, hits / queried, hits / queried)]
    for factor in factors:
        exact = serve(requests, round(capacity * factor)) * BLOCK_TOKENS / queried
        projected = min(1.0, (hits + kept[factor - 1] * BLOCK_TOKENS) / queried)
        rows.append((factor, exact, projected))
    return rows


def whole_blocks(requests: list[Request]) -> list[Request]:
    """The requests with their prompts cut to their whole blocks: each ends on a block boundary, where the last
    block of a store is one no pool serves (docs/kv-events.md, "Blocks no pool would have served")."""
    return [Request(request.ts, len(request.blocks) * BLOCK_TOKENS, request.blocks) for request in requests
            if request.blocks]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.whatif_trace", description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=None, help="the first N requests of each trace (all)")
    args = parser.parse_args(argv)
    print("| trace | C (blocks) | factor | exact LRU hit ratio at C x factor | exporter's projection | difference "
          "| difference, prompts cut to whole blocks |")
    print("|---|---|---|---|---|---|---|")
    for name, capacities in CAPACITIES.items():
        requests = load(name, args.requests)
        cut = whole_blocks(requests)
        for capacity in capacities:
            for (factor, exact, projected), (_, exact_cut, projected_cut) in zip(compare(requests, capacity),
                                                                                  compare(cut, capacity)):
                if factor == 1.0:
                    print(f"| {name} ({len(requests):,} requests) | {capacity:,} | x1 | {exact:.2%} | | | |")
                    continue
                print(f"| | | x{factor:g} | {exact:.2%} | {projected:.2%} | {(projected - exact) * 100:+.2f} pp "
                      f"| {(projected_cut - exact_cut) * 100:+.2f} pp |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
