"""The host-tier golden streams: KV event batches of a GPU pool with vLLM's native CPU offload, the CPU tier's
events from vLLM's own offload code (the CPU build cannot start an engine with offloading: tests/real/
test_vllm_offload.py).

    .venv-vllm/bin/python devtools/offload_golden.py

The CPU tier is vLLM 0.32's CPUOffloadingManager (vllm/v1/kv_offload/cpu/manager.py, its default LRU policy,
one block per chunk, events on), driven as the connector's scheduler drives it (offloading/scheduler.py): per
request, lookup of each block the GPU pool lacks; a hit is loaded (prepare_load, complete_load) and a miss is
computed and stored after (prepare_store, complete_store), on_request_finished at the end. Its events go
through the connector's OffloadingEventsTracker.take_events (placeholder payloads, medium "CPU", the block hash
in vLLM's int form) after the GPU pool's, in one KVEventBatch per request, encoded as ZmqEventPublisher encodes
it (msgspec msgpack). The GPU pool's events are written here as vLLM's block pool publishes them
(BlockStored at schedule time, medium "GPU", block_size 16; one BlockRemoved per block reallocated, least
recently used first): an LRU of GPU_BLOCKS blocks, each request touching its blocks.

The workload (seeded): REQUESTS requests of a prefix of 2 blocks drawn from PREFIXES, Zipf-like, so the GPU
pool keeps the hot ones and the CPU tier serves part of the rest. Written for three CPU tiers, HOST_CHUNKS,
1.5 and 2 times that, the same requests in the same order: `vllm-cpu-<chunks>.msgpack.gz` (a gzipped msgpack
array of [seq, payload] pairs, the frames the exporter would receive) and `truth.json`, what vLLM's manager did
in each run (blocks it served by load, stored, evicted; stores of keys it had evicted before), the figures
tests/unit/test_kv_tiers.py holds the exporter's counts to.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import random
import sys
from collections import OrderedDict
from pathlib import Path


GOLDEN = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "offload-golden"
GPU_BLOCKS = 8
HOST_CHUNKS = 24
PREFIXES = 40
BLOCKS_PER_PREFIX = 2
REQUESTS = 600
BLOCK_SIZE = 16
SEED = 45


def block_hash(prefix: int, index: int) -> bytes:
    return hashlib.sha256(f"prefix {prefix} block {index}".encode()).digest()


def workload() -> list[int]:
    rng = random.Random(SEED)
    weights = [1 / (rank + 1) for rank in range(PREFIXES)]
    return rng.choices(range(PREFIXES), weights, k=REQUESTS)


def run(chunks: int, prefixes: list[int]) -> tuple[list[list], dict]:
    from vllm.distributed.kv_events import MEDIUM_GPU, BlockRemoved, BlockStored, KVEventBatch
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.events import OffloadingEventsTracker
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash
    from vllm.v1.kv_offload.base import LookupResult, OffloadingKVEventsConfig, ReqContext, make_offload_key
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager
    import msgspec

    manager = CPUOffloadingManager(num_chunks=chunks, enable_events=True)
    tracker = OffloadingEventsTracker(OffloadingKVEventsConfig(enable_kv_cache_events=True,
                                                               self_describing_kv_events=False))
    encoder = msgspec.msgpack.Encoder()
    gpu: OrderedDict[bytes, None] = OrderedDict()
    evicted_keys: set = set()
    truth = {"served": 0, "host_stored": 0, "host_evicted": 0, "host_restored_after_eviction": 0,
             "gpu_stored": 0, "gpu_evicted": 0}
    messages = []
    for seq, prefix in enumerate(prefixes):
        context = ReqContext(req_id=f"r{seq}")
        manager.on_new_request(context)
        events = []
        to_store = []
        parent = None
        for index in range(BLOCKS_PER_PREFIX):
            digest = block_hash(prefix, index)
            if digest in gpu:  # a GPU hit: the block moves to the LRU's top, no event
                gpu.move_to_end(digest)
                parent = digest
                continue
            key = make_offload_key(digest, 0)
            context.set_offload_key_position(key, (index + 1) * BLOCK_SIZE)
            if manager.lookup(key, context) is LookupResult.HIT:
                manager.prepare_load([key], context)
                manager.complete_load([key], context)
                truth["served"] += 1
            else:
                to_store.append(key)
            if len(gpu) >= GPU_BLOCKS:
                victim, _ = gpu.popitem(last=False)
                events.append(BlockRemoved(block_hashes=[maybe_convert_block_hash(victim)], medium=MEDIUM_GPU,
                                           group_idx=0))
                truth["gpu_evicted"] += 1
            gpu[digest] = None
            events.append(BlockStored(block_hashes=[maybe_convert_block_hash(digest)],
                                      parent_block_hash=maybe_convert_block_hash(parent) if parent else None,
                                      token_ids=list(range(BLOCK_SIZE)), block_size=BLOCK_SIZE, lora_id=None,
                                      medium=MEDIUM_GPU, lora_name=None, group_idx=0))
            truth["gpu_stored"] += 1
            parent = digest
        if to_store:
            output = manager.prepare_store(to_store, context)
            if output is not None:
                truth["host_evicted"] += len(output.evicted_keys)
                evicted_keys.update(output.evicted_keys)
                stored = list(output.keys_to_store)
                truth["host_stored"] += len(stored)
                truth["host_restored_after_eviction"] += sum(1 for key in stored if key in evicted_keys)
                manager.complete_store(stored, context)
        manager.on_request_finished(context)
        events.extend(tracker.take_events(manager.take_events()))
        batch = KVEventBatch(ts=1_800_000_000.0 + seq, events=events, data_parallel_rank=0)
        messages.append([seq, encoder.encode(batch)])
    return messages, truth


def main() -> int:
    import msgspec

    prefixes = workload()
    GOLDEN.mkdir(parents=True, exist_ok=True)
    truths = {}
    for chunks in (HOST_CHUNKS, HOST_CHUNKS * 3 // 2, 2 * HOST_CHUNKS):
        messages, truth = run(chunks, prefixes)
        (GOLDEN / f"vllm-cpu-{chunks}.msgpack.gz").write_bytes(gzip.compress(msgspec.msgpack.encode(messages),
                                                                            mtime=0))
        truths[str(chunks)] = truth
    (GOLDEN / "truth.json").write_text(json.dumps(
        {"gpu_blocks": GPU_BLOCKS, "block_size": BLOCK_SIZE, "requests": REQUESTS, "runs": truths}, indent=1) + "\n")
    print(json.dumps(truths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
