"""The fleet index (exporter/fleet.py) at fleet scale: memory per tracked block, block events per CPU-second, and
the sampled estimate of the routing loss against the workload's own count.

    python -m bench.fleet_index [--replicas 100] [--blocks 30000] [--max-blocks 1000000]

The workload: requests of one model routed at random over `replicas` pools of `blocks` blocks each (16 tokens a
block, LRU): each request one of 5,000 shared prefixes of 8 blocks (drawn with a Zipf-like skew) and 4 blocks of its
own. A pool stores the blocks it does not hold (a BlockStored of the chain's new blocks, token ids included, its
engine hashes under a seed of its own) and evicts its least recently used blocks beyond its size (BlockRemoved).
The workload counts the truth itself: the tokens of every block stored while another pool held the same block.
The pools are filled, then as many blocks again are stored (the steady state, measured).

Memory: the index's dicts and integers (sys.getsizeof, walked), divided by the replica-blocks it tracks; run exact
(max_blocks above the fleet's blocks) at a tenth of the replicas, and sampled at the full size.
Throughput: CPU time in FleetIndex.apply alone (the decoder's share is bench/kvevents.py's), per block event (one
hash of a BlockStored or BlockRemoved).
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections import OrderedDict

from kvcache_exporter.fleet import FleetIndex
from kvcache_exporter.sources.kvevents import REMOVED, STORED, BlockEvent

BLOCK_SIZE = 16
PREFIXES, PREFIX_BLOCKS, OWN_BLOCKS = 5000, 8, 4
MASK64 = (1 << 64) - 1


def _tokens(content: int) -> list[int]:
    """A block's token ids: its content id in the first two (distinct blocks, distinct tokens), filler after."""
    return [content % 32000, content // 32000, *((content * 7 + i) % 32000 for i in range(BLOCK_SIZE - 2))]


def run(replicas: int, blocks: int, max_blocks: int, seed: int = 1) -> dict:
    rng = random.Random(seed)
    index = FleetIndex(max_blocks)
    pools = [OrderedDict() for _ in range(replicas)]  # content id -> engine hash, least recently used first
    holders: dict[int, int] = {}  # content id -> pools holding it
    truth = events = 0
    matched: dict[int, int] = {}  # content id -> tokens it was recomputed while held (the steady state)
    cpu = 0.0
    next_own = PREFIXES * PREFIX_BLOCKS
    target = 2 * replicas * blocks  # stores: fill the pools, then as many again
    stored = 0
    measured_from = replicas * blocks
    baseline = None
    while stored < target:
        replica = rng.randrange(replicas)
        prefix = int(PREFIXES * rng.random() ** 2)
        chain = [prefix * PREFIX_BLOCKS + j for j in range(PREFIX_BLOCKS)] + list(range(next_own, next_own + OWN_BLOCKS))
        next_own += OWN_BLOCKS
        pool = pools[replica]
        start = 0  # the chain's blocks the pool holds: a prefix of it (see the LRU order below)
        while start < len(chain) and chain[start] in pool:
            start += 1
        new = chain[start:]
        parent = pool[chain[start - 1]] if start else None
        hashes = [hash((replica, content)) & MASK64 for content in new]
        batch = [BlockEvent(STORED, hashes, parent=parent, token_ids=[t for c in new for t in _tokens(c)],
                            block_size=BLOCK_SIZE)]
        measured = stored >= measured_from  # the whole batch: in the steady state or in the fill
        for content, engine_hash in zip(new, hashes):
            if measured and holders.get(content, 0) > 0:
                truth += BLOCK_SIZE
                matched[content] = matched.get(content, 0) + BLOCK_SIZE
            pool[content] = engine_hash
            holders[content] = holders.get(content, 0) + 1
            stored += 1
        for content in reversed(chain):  # used last, its head newest: a pool evicts a chain from its tail
            pool.move_to_end(content)
        evicted = []
        while len(pool) > blocks:
            content, engine_hash = pool.popitem(last=False)
            holders[content] -= 1
            evicted.append(engine_hash)
        if evicted:
            batch.append(BlockEvent(REMOVED, evicted))
        if not measured:
            index.apply(replica, "model", batch)
            continue
        if baseline is None:
            baseline = index.models["model"].recomputed_tokens
        events += len(new) + len(evicted)
        began = time.process_time()
        index.apply(replica, "model", batch)
        cpu += time.process_time() - began
    fleet = index.models["model"]
    # Spatial sampling keeps or drops a block with all its matches: the estimate's variance is (1 - r) / r times
    # the sum of the squared per-block counts (the rate in force at the end; it was higher before).
    rate = index.rate
    error = ((1 - rate) / rate * sum(c * c for c in matched.values())) ** 0.5 / truth if truth else float("nan")
    return {"replicas": replicas, "blocks": blocks, "tracked": index.tracked, "rate": index.rate,
            "standard_error": error,
            "bytes": index_bytes(index), "events_per_cpu_second": events / cpu if cpu else float("nan"),
            "estimate": fleet.recomputed_tokens - baseline, "truth": truth}


def index_bytes(index: FleetIndex) -> int:
    """The index's dicts and the integers in them (small ints are shared: counted anyway, an overstatement)."""
    total = sys.getsizeof(index.models)
    for fleet in index.models.values():
        total += sys.getsizeof(fleet.holders) + sum(sys.getsizeof(k) + sys.getsizeof(v) for k, v in fleet.holders.items())
        for replica in fleet.replicas.values():
            for mapping in (replica.keys, replica.copies):
                total += sys.getsizeof(mapping) + sum(sys.getsizeof(k) + sys.getsizeof(v) for k, v in mapping.items())
    return total


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.fleet_index", description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=100)
    parser.add_argument("--blocks", type=int, default=30_000)
    parser.add_argument("--max-blocks", type=int, default=1_000_000)
    args = parser.parse_args(argv)
    small = max(3, args.replicas // 10)
    for name, result in (("exact", run(small, args.blocks, 10 * small * args.blocks)),
                         ("sampled", run(args.replicas, args.blocks, args.max_blocks))):
        rate = result["rate"]
        error = (result["estimate"] - result["truth"]) / result["truth"]
        print(f"{name}: {result['replicas']} replicas x {result['blocks']:,} blocks, max_blocks "
              f"{args.max_blocks if name == 'sampled' else 10 * small * args.blocks:,}: {result['tracked']:,} "
              f"replica-blocks tracked at sampling rate {rate:g}, {result['bytes'] / 2**20:,.0f} MiB, "
              f"{result['bytes'] / max(1, result['tracked']):.0f} bytes per tracked block")
        print(f"  {result['events_per_cpu_second']:,.0f} block events per CPU-second in the index; routing loss "
              f"{result['estimate']:,.0f} tokens estimated vs {result['truth']:,} counted by the workload "
              f"({error:+.2%}; stated bound 3 standard errors: +-{3 * result['standard_error']:.2%})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
