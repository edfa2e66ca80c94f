"""The simulated engines' KV event streams: the pool's journal as vLLM's and SGLang's batches on a ZMQ PUB.

Layout as the engines write it today: a batch `[ts, events, dp_rank]` of tagged maps; vLLM's block
hashes unsigned 64-bit, SGLang's signed (the same 64 bits). A block's hash comes from its content key,
so the same prefix block has the same hash in every request, as a real prefix cache's chained hash.
One batch per scheduler step that stored or evicted blocks; a restart (a new generation of the model)
sends AllBlocksCleared, as the real pool is empty after it. A store names its blocks' LoRA adapter
(`lora_name`) and tenant (the cache salt: SGLang's `cache_salt` key, vLLM's typed extra_keys entry
on the first block), after simulator.workload.holder.
"""

from __future__ import annotations

import hashlib
import threading

import msgpack

from .model import STORED, BlockKey
from .workload import holder

SIGNED_HASHES = {"sglang"}  # flavors whose hashes are signed int64; the rest publish vLLM's unsigned form


def block_hash(key: BlockKey) -> int:
    return int.from_bytes(hashlib.blake2b(repr(key).encode(), digest_size=8).digest(), "big")


def events(journal: list[tuple[str, BlockKey]], block_size: int, signed: bool) -> list[dict]:
    """The journal as tagged-map events: consecutive stores of one holder in one BlockStored, each
    eviction its own BlockRemoved (as vLLM's pool emits them)."""
    out: list[dict] = []
    last_holder = None
    for kind, key in journal:
        value = block_hash(key)
        if signed and value >= 1 << 63:
            value -= 1 << 64
        if kind == STORED:
            adapter, salt = holder(key)
            if out and out[-1]["type"] == "BlockStored" and last_holder == (adapter, salt):
                out[-1]["block_hashes"].append(value)
                if not signed:
                    out[-1]["extra_keys"].append(None)
                continue
            last_holder = (adapter, salt)
            event = {"type": "BlockStored", "block_hashes": [value], "parent_block_hash": None, "token_ids": [],
                     "block_size": block_size, "lora_id": None, "medium": "GPU", "lora_name": adapter}
            if signed:
                event["cache_salt"] = salt
            else:
                event["extra_keys"] = [[["cache_salt", salt]]]
            out.append(event)
        else:
            out.append({"type": "BlockRemoved", "block_hashes": [value], "medium": "GPU"})
    return out


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
