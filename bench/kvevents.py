"""KV event streams: block events decoded and tracked per second on one core, and bytes per tracked block.

    python -m bench.kvevents [--blocks N]

Throughput: the simulator's LRU workload (tests/unit/test_kvevents_whatif.py) played as vLLM's wire batches
(tagged maps, 64-bit hashes, the store events carrying their token ids as vLLM sends them: 16 per block, and
512 as with the large blocks of hybrid models), decoded by
exporter.sources.kvevents and folded by exporter.blocks, in this process on one core: CPU time, best
of 5. A block event is one hash of a BlockStored or BlockRemoved.

Memory: tracemalloc's count of the bytes a pool's state of N blocks holds at its largest (N resident, 4 x N
evicted and still out, the order of evictions at 2 x 4 x N positions, its bound), divided by the blocks it
tracks (resident + still out).
"""

from __future__ import annotations

import argparse
import time
import tracemalloc
from collections import deque

import msgpack

from kvcache_exporter.blocks import GHOST_FACTOR, PoolState
from kvcache_exporter.sources.kvevents import REMOVED, STORED, BlockEvent, decode_payload
from kvcache_exporter.simulator import kvevents as sim_events
from kvcache_exporter.simulator.exposition import FLAVORS
from kvcache_exporter.simulator.scenarios import ScenarioRun, load_scenario, override_engine

BLOCK_SIZE = 16
VLLM_LARGE_BLOCK = 512  # token ids per stored block where the engine chose large blocks (hybrid models)
CAPACITY = 1024
WORKLOAD = """
name: lru-prefixes
then: hold
phases:
  - {name: prefixes, duration_s: 1800, arrival_rate: 1, prefix_share: 1.0, num_prefixes: 40, prefix_len: 512,
     prompt_len: {dist: lognormal, median: 64, sigma: 0.5, min: 16, max: 400},
     output_len: {dist: lognormal, median: 40, sigma: 0.5, min: 8, max: 200}}
"""


def payloads(token_ids_per_block: int) -> tuple[list[bytes], int]:
    """The workload's batches on the wire, each stored block with this many token ids, and the block events in
    them."""
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".yml") as handle:
        handle.write(WORKLOAD)
        handle.flush()
        scenario = override_engine(load_scenario(handle.name), {"num_blocks": CAPACITY})
    engine = ScenarioRun(scenario, FLAVORS["vllm-v1"].reporting, seed=1, record_kv_events=True)
    engine.advance_to(1800)
    out, blocks = [], 0
    for ts, journal in engine.models[0].kv_batches:
        events = sim_events.events(journal, BLOCK_SIZE, signed=False)
        for event in events:  # vLLM sends each stored block's tokens: the bytes a real decoder reads
            if event["type"] == "BlockStored":
                event["token_ids"] = list(range(100_000, 100_000 + token_ids_per_block * len(event["block_hashes"])))
            blocks += len(event["block_hashes"])
        out.append(msgpack.packb([ts, events, 0]))
    return out, blocks


def throughput(batches: list[bytes], blocks: int) -> tuple[float, float]:
    best = float("inf")
    for _ in range(5):
        pool = PoolState(capacity=CAPACITY)
        start = time.process_time()
        for seq, payload in enumerate(batches):
            batch = decode_payload(seq, payload, 1 << 24)
            pool.apply(batch.ts, batch.events)
        best = min(best, time.process_time() - start)
    decode_only = float("inf")
    for _ in range(5):
        start = time.process_time()
        for seq, payload in enumerate(batches):
            decode_payload(seq, payload, 1 << 24)
        decode_only = min(decode_only, time.process_time() - start)
    return blocks / best, blocks / decode_only


def bytes_per_block(capacity: int) -> float:
    """Bytes per tracked block with the list of evictions at its largest: `capacity` blocks resident, 4 x that
    evicted and still out, and the order of evictions just short of its compaction (2 x 4 x capacity positions,
    half of them blocks that came back)."""
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    pool = PoolState(capacity=capacity)
    limit = GHOST_FACTOR * capacity
    stored = [(0x9E3779B97F4A7C15 * i) & (2**64 - 1) for i in range(1, limit + capacity + 1)]
    pool.apply(1.0, [BlockEvent(STORED, stored[start:start + 64]) for start in range(0, len(stored), 64)])
    # 0: the block the evictions made room for, and the last block of every store below (a store's last block is
    # never a capacity miss), which stays cached
    pool.apply(2.0, [BlockEvent(REMOVED, stored[:limit - 1]), BlockEvent(STORED, [0])])
    back, residents = stored[limit - 2], deque(stored[limit - 1:])
    for _ in range(limit - 1):  # the pool's oldest leaves, a block comes back: one position more, as many out
        leaving = residents.popleft()
        pool.apply(3.0, [BlockEvent(REMOVED, [leaving]), BlockEvent(STORED, [back, 0])])
        residents.append(back)
        back = leaving
    pool.apply(4.0, [BlockEvent(REMOVED, [residents.popleft()])])
    del stored, residents
    used = tracemalloc.get_traced_memory()[0] - before
    assert len(pool.ghost) == limit and len(pool._ghost_keys) == 2 * limit - 1
    tracked = len(pool.resident) + len(pool.ghost)
    tracemalloc.stop()
    return used / tracked


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.kvevents", description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=100_000, help="pool capacity for the memory figure")
    args = parser.parse_args(argv)
    for token_ids in (BLOCK_SIZE, VLLM_LARGE_BLOCK):
        batches, blocks = payloads(token_ids)
        size = sum(map(len, batches))
        tracked, decoded = throughput(batches, blocks)
        print(f"{token_ids} token ids per stored block: {len(batches)} batches, {blocks} block events, "
              f"{size / 1e6:.1f} MB on the wire")
        print(f"  decoded and tracked: {tracked:,.0f} block events per CPU-second (decode alone {decoded:,.0f})")
    print(f"memory: {bytes_per_block(args.blocks):.0f} bytes per tracked block "
          f"(pool of {args.blocks} blocks, ghost list of {GHOST_FACTOR * args.blocks})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
