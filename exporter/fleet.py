"""Fleet prefix locality: which replicas of one model hold which prompt blocks, and the routing loss.

Every replica (a stream's pool: a target and DP rank) of one model feeds one index. A block is matched across
replicas by what it holds, its content key: a digest of its token ids chained to its parent's content key (the
first block of a chain: its adapter and tenant instead), as the KV of a block depends on every token before it.
Each replica's engine hashes map to content keys, so a fleet whose engines hash with different seeds (vLLM's
default without PYTHONHASHSEED) still meets on shared prefixes. A store without token ids (a stream that sends
hashes only) is keyed by its engine hash: it meets its siblings only where the fleet shares the hash seed.

A replica that stores a block it did not hold while a sibling held the same content at that moment computed
prompt tokens a router could have sent to the sibling: the routing loss. That is also what a perfect
prefix-affinity router would have gained on this window, and never more than the siblings could keep: the
sibling did hold the block when it was recomputed.

Memory: exact up to `max_blocks` tracked replica-blocks; beyond, spatial sampling as in SHARDS (Waldspurger et
al., FAST'15): only content keys below a threshold are tracked (the same decision on every replica, as the key
is the content's), the threshold halves each time the index is full again, and the counts are scaled by the rate
in force when they were counted. A block whose parent was sampled out is keyed by the parent's engine hash (the
shared-seed fallback): on a fleet without a shared seed, sampling loses such chains' matches (an undercount,
never a false one). Pure: no I/O, no clock.
"""

from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass, field

from .blocks import GPU_MEDIA
from .contract import ISOLATED_MIN_BLOCKS, ISOLATED_SIBLING_SHARE
from .sources.kvevents import CLEARED, REMOVED, STORED, BlockEvent

KEY_SPACE = 1 << 64


def _digest(*parts: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(b"".join(parts), digest_size=8).digest(), "big")


def _key_bytes(key: int) -> bytes:
    return key.to_bytes(8, "big")


def root_key(adapter: str | None, tenant: str | None) -> bytes:
    """What a chain's first block is chained to: blocks of another adapter or tenant are other KV."""
    return f"root\0{adapter or ''}\0{tenant or ''}".encode()


def hash_key(engine_hash: int) -> int:
    """The key of a block known by its engine hash only, spread evenly (sampling compares keys to a threshold)."""
    return _digest(b"hash", _key_bytes(engine_hash))


def content_keys(chain: bytes, token_ids: list[int], block_size: int, blocks: int) -> list[int] | None:
    """Each block's content key, chained from `chain` (the parent's key bytes, or a root); None where the token ids
    are not `blocks` whole blocks of ints."""
    if len(token_ids) != block_size * blocks:
        return None
    try:
        packed = array("q", token_ids).tobytes()
    except (TypeError, OverflowError):
        return None
    keys, step = [], 8 * block_size
    for start in range(0, len(packed), step):
        key = _digest(chain, packed[start:start + step])
        keys.append(key)
        chain = _key_bytes(key)
    return keys


@dataclass(slots=True)
class Replica:
    bit: int
    keys: dict[int, int] = field(default_factory=dict)  # engine hash -> content key, of its tracked blocks
    copies: dict[int, int] = field(default_factory=dict)  # engine hash -> copies beyond the first
    stored: int = 0  # tracked blocks it stored
    met: int = 0  # blocks it stored that a sibling held, or held when a sibling stored them


@dataclass
class ModelFleet:
    """One model's replicas and the index of their blocks; the counts are estimates scaled by the sampling rate."""

    replicas: dict[object, Replica] = field(default_factory=dict)
    by_bit: dict[int, Replica] = field(default_factory=dict)
    holders: dict[int, int] = field(default_factory=dict)  # content key -> bit mask of the replicas holding it
    stored_tokens: float = 0.0  # tokens in the blocks the replicas stored (exact)
    recomputed_tokens: float = 0.0  # of those, held by a sibling at the time
    hash_only_blocks: float = 0.0  # blocks stored without token ids: matched by engine hash
    hash_mismatch_blocks: float = 0.0  # blocks matched by content whose engine hash differs from the sibling's

    def replica(self, name: object) -> Replica:
        replica = self.replicas.get(name)
        if replica is None:
            taken = {r.bit for r in self.replicas.values()}
            bit = next(1 << i for i in range(len(taken) + 1) if 1 << i not in taken)
            replica = self.replicas[name] = self.by_bit[bit] = Replica(bit)
        return replica

    def drop_blocks(self, replica: Replica) -> int:
        """Forget every block of `replica` (cleared, restarted, gone); the tracked entries freed."""
        clear = ~replica.bit
        for key in replica.keys.values():
            self._release(key, clear)
        freed = len(replica.keys)
        replica.keys, replica.copies = {}, {}
        return freed

    def _release(self, key: int, clear: int) -> None:
        mask = self.holders.get(key)
        if mask is not None:
            mask &= clear
            if mask:
                self.holders[key] = mask
            else:
                del self.holders[key]

    def isolated(self) -> int:
        """Replicas whose blocks never met a sibling's while the siblings met each other's: a different hash seed
        (hash-only streams), model revision or tokenizer. Needs three replicas: with two, a cold workload and a
        replica apart look the same."""
        count = 0
        for name, replica in self.replicas.items():
            if replica.met or replica.stored < ISOLATED_MIN_BLOCKS:
                continue
            others = [r for n, r in self.replicas.items() if n != name]
            stored = sum(r.stored for r in others)
            if len(others) >= 2 and stored and sum(r.met for r in others) >= ISOLATED_SIBLING_SHARE * stored:
                count += 1
        return count


class FleetIndex:
    """Every model's fleet, fed by every stream of this process; one memory bound over all of them."""

    def __init__(self, max_blocks: int):
        self.max_blocks = max_blocks
        self.threshold = KEY_SPACE  # content keys below it are tracked
        self.tracked = 0  # replica-blocks tracked, over every model
        self.models: dict[str, ModelFleet] = {}
        self._model_of: dict[object, str] = {}

    @property
    def rate(self) -> float:
        return self.threshold / KEY_SPACE

    def apply(self, name: object, model: str, events: list[BlockEvent]) -> None:
        """Fold one batch of replica `name`'s events (a replica of `model`) into the index."""
        fleet = self._fleet(name, model)
        replica = fleet.replica(name)
        for event in events:
            if event.kind == CLEARED:
                self.tracked -= fleet.drop_blocks(replica)
            elif event.medium not in GPU_MEDIA or event.group_idx:
                continue  # the GPU pool's full-attention group only, as exporter.blocks does
            elif event.kind == STORED:
                self._store(fleet, replica, event)
            elif event.kind == REMOVED:
                self._remove(fleet, replica, event.hashes)
        if self.tracked > self.max_blocks:
            self._lower_threshold()

    def join(self, name: object, model: str) -> None:
        """Replica `name` serves `model`: its fleet's series show from then on, before any block is stored."""
        self._fleet(name, model).replica(name)

    def forget(self, name: object, drop: bool = False) -> None:
        """Replica `name` restarted (its blocks are gone) or, with `drop`, left the fleet."""
        model = self._model_of.get(name)
        if model is None:
            return
        fleet = self.models[model]
        self.tracked -= fleet.drop_blocks(fleet.replica(name))
        if drop:
            del fleet.by_bit[fleet.replicas.pop(name).bit], self._model_of[name]

    def _fleet(self, name: object, model: str) -> ModelFleet:
        if self._model_of.get(name, model) != model:  # its engine now names another model
            self.forget(name, drop=True)
        self._model_of[name] = model
        fleet = self.models.get(model)
        if fleet is None:
            fleet = self.models[model] = ModelFleet()
        return fleet

    def _store(self, fleet: ModelFleet, replica: Replica, event: BlockEvent) -> None:
        hashes, size, scale = event.hashes, event.block_size or 0, 1.0 / self.rate
        fleet.stored_tokens += size * len(hashes)
        keys = None
        if event.token_ids is not None and size:
            parent = replica.keys.get(event.parent) if event.parent is not None else None
            chain = (root_key(event.adapter, event.tenant) if event.parent is None
                     else _key_bytes(parent) if parent is not None
                     else b"parent\0" + _key_bytes(event.parent))  # sampled out or stored before we joined
            keys = content_keys(chain, event.token_ids, size, len(hashes))
        if keys is None:
            keys = [hash_key(h) for h in hashes]
            fleet.hash_only_blocks += len(hashes) * scale
            by_content = False
        else:
            by_content = True
        holders, threshold, bit, own = fleet.holders, self.threshold, replica.bit, replica.keys
        for engine_hash, key in zip(hashes, keys):
            if key >= threshold:
                continue
            if engine_hash in own:  # a second copy of a block it holds (vLLM recomputes a prompt's last block)
                replica.copies[engine_hash] = replica.copies.get(engine_hash, 0) + 1
                continue
            own[engine_hash] = key
            self.tracked += 1
            replica.stored += 1
            mask = holders.get(key, 0)
            holders[key] = mask | bit
            siblings = mask & ~bit
            if siblings:
                sibling = fleet.by_bit[siblings & -siblings]  # one of them: the lowest bit's
                replica.met += 1
                sibling.met += 1
                fleet.recomputed_tokens += size * scale
                if by_content and sibling.keys.get(engine_hash) != key:  # it knows the block by another hash
                    fleet.hash_mismatch_blocks += scale

    def _remove(self, fleet: ModelFleet, replica: Replica, hashes: list[int]) -> None:
        own, copies, clear = replica.keys, replica.copies, ~replica.bit
        for engine_hash in hashes:
            extra = copies.get(engine_hash)
            if extra is not None:  # another copy stays resident
                if extra > 1:
                    copies[engine_hash] = extra - 1
                else:
                    del copies[engine_hash]
                continue
            key = own.pop(engine_hash, None)
            if key is not None:
                self.tracked -= 1
                fleet._release(key, clear)

    def _lower_threshold(self) -> None:
        """Halve the sampling rate until the tracked blocks fit, forgetting those now above the threshold."""
        while self.tracked > self.max_blocks and self.threshold > 1:
            self.threshold //= 2
            threshold = self.threshold
            for fleet in self.models.values():
                for replica in fleet.replicas.values():
                    gone = [h for h, key in replica.keys.items() if key >= threshold]
                    for engine_hash in gone:
                        key = replica.keys.pop(engine_hash)
                        replica.copies.pop(engine_hash, None)
                        fleet._release(key, ~replica.bit)
                    self.tracked -= len(gone)
