"""The simulated engines' KV event streams: the pool's journal as vLLM's and SGLang's batches on a ZMQ PUB.

Layout as the engines write it today: a batch `[ts, events, dp_rank]` of tagged maps; vLLM's block
hashes unsigned 64-bit, SGLang's signed (the same 64 bits). A block's hash comes from its content key,
so the same prefix block has the same hash in every request, as a real prefix cache's chained hash.
One batch per scheduler step that stored or evicted blocks; a restart (a new generation of the model)
sends AllBlocksCleared, as the real pool is empty after it.

A BlockStored holds consecutive blocks of one chain (each the next block of the same request, of one
adapter and tenant, after simulator.workload.holder), with the hash of the block before the first as
its parent and token ids for every block, as both engines send them. The fields are vLLM 0.32's
(vllm/distributed/kv_events.py, v1/core/block_pool.py; msgspec omits an unset default): `lora_id`,
`lora_name`, `group_idx` 0 and the untagged `extra_keys`, one entry per block, the adapter's name on
every block and the cache salt on a request's first block only (v1/core/kv_cache_utils.py,
generate_block_hash_extra_keys and to_event_extra_keys), so a later block's tenant is its chain's. SGLang
names the salt on every store (`cache_salt`).

With an offload tier its stores and evictions ride in the same batches, one block each, tokenless, medium
`CPU` (SGLang flavors: `CPU_PINNED`), as vLLM's offloading connector announces its chunks by default.
"""

from __future__ import annotations

import hashlib
import threading

import msgpack

from .model import STORED, TIER_REMOVED, TIER_STORED, BlockKey
from .workload import ADAPTERS, holder

SIGNED_HASHES = {"sglang"}  # flavors whose hashes are signed int64; the rest publish vLLM's unsigned form
VOCABULARY = 32000  # token ids of the simulated blocks: made up, as the simulator has no tokens


def block_hash(key: BlockKey) -> int:
    return int.from_bytes(hashlib.blake2b(repr(key).encode(), digest_size=8).digest(), "big")


def _wire_hash(key: BlockKey, signed: bool) -> int:
    value = block_hash(key)
    return value - (1 << 64) if signed and value >= 1 << 63 else value


def _tokens(value: int, block_size: int) -> list[int]:
    return [(value >> (i % 48)) % VOCABULARY for i in range(block_size)]


def events(journal: list[tuple], block_size: int, signed: bool) -> list[dict]:
    """The journal as tagged-map events: the stores of one chain in one BlockStored, each eviction its
    own BlockRemoved (as vLLM's pool emits them)."""
    out: list[dict] = []
    chain = None  # (the last stored key, its owner) while a BlockStored is open
    for entry in journal:
        if entry[0] in (TIER_STORED, TIER_REMOVED):
            out.append(_tier_event(entry[0], entry[1], signed))
            chain = None
            continue
        if entry[0] != STORED:
            out.append({"type": "BlockRemoved", "block_hashes": [_wire_hash(entry[1], signed)], "medium": "GPU"})
            chain = None
            continue
        _, key, parent, owner = entry
        value = _wire_hash(key, signed)
        if chain is None or chain != (parent, owner):
            out.append(_stored(parent, owner, block_size, signed))
        event = out[-1]
        event["block_hashes"].append(value)
        event["token_ids"].extend(_tokens(value, block_size))
        if not signed:
            adapter, salt = holder(owner)
            keys = ((adapter,) if adapter else ()) + ((salt,) if key[-1] == 0 else ())
            event["extra_keys"].append(list(keys) or None)
        chain = (key, owner)
    for event in out:  # omitted where no block has a key, as msgspec omits an unset default
        if event.get("extra_keys") is not None and not any(event["extra_keys"]):
            del event["extra_keys"]
    return out


def _stored(parent: BlockKey | None, owner: int, block_size: int, signed: bool) -> dict:
    adapter, salt = holder(owner)
    event = {"type": "BlockStored", "block_hashes": [], "parent_block_hash": None if parent is None
             else _wire_hash(parent, signed), "token_ids": [], "block_size": block_size,
             "lora_id": ADAPTERS.index(adapter) if adapter else None, "medium": "GPU", "lora_name": adapter}
    if signed:
        event["cache_salt"] = salt
    else:
        event["extra_keys"] = []
        event["group_idx"] = 0
    return event


def _tier_event(kind: str, key: BlockKey, signed: bool) -> dict:
    """The offload tier's store or eviction of one block, as vLLM's offloading connector announces it by
    default (one chunk of one block, tokenless, no parent: OffloadingEventsTracker's placeholder payload), or
    SGLang's HiCache its host copy (CPU_PINNED)."""
    medium = "CPU_PINNED" if signed else "CPU"
    if kind == TIER_REMOVED:
        return {"type": "BlockRemoved", "block_hashes": [_wire_hash(key, signed)], "medium": medium}
    return {"type": "BlockStored", "block_hashes": [_wire_hash(key, signed)], "parent_block_hash": None,
            "token_ids": [], "block_size": 0, "lora_id": None, "medium": medium, "lora_name": None}


def batch(ts: float, events_: list[dict], dp_rank: int) -> bytes:
    return msgpack.packb([ts, events_, dp_rank])


CLEARED = [{"type": "AllBlocksCleared"}]


class Publisher:
    """One PUB socket per DP rank, on the endpoint's port plus the rank (the engines' convention)."""

    def __init__(self, endpoint: str, ranks: int):
        import zmq  # only a simulator that publishes needs it

        self._context = zmq.Context()
        self._sockets = []
        base, _, port = endpoint.rpartition(":")
        try:
            for rank in range(ranks):
                socket = self._context.socket(zmq.PUB)
                socket.setsockopt(zmq.LINGER, 0)
                self._sockets.append(socket)
                socket.bind(f"{base}:{int(port) + rank}")
        except zmq.ZMQError:  # a port in use: nothing stays bound
            self.close()
            raise
        self._seq = [0] * ranks
        self._lock = threading.Lock()

    def send(self, rank: int, payload: bytes) -> None:
        with self._lock:
            seq = self._seq[rank]
            self._seq[rank] = seq + 1
            self._sockets[rank].send_multipart([b"", seq.to_bytes(8, "big"), payload])

    def close(self) -> None:
        for socket in self._sockets:
            socket.close()
        self._context.term()
