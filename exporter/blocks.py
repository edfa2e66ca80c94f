"""One KV pool's state folded from its event stream: which blocks are resident, which were evicted
recently, and the capacity misses (blocks stored again after an eviction) with their distance.

Pure: no I/O, no clock; the batches' timestamps are the only time. The distance of a capacity miss is
the number of blocks the pool evicted after the block and that have not been stored again since: under
LRU, the blocks evicted lie below the pool's last block in the order they left it, and one that comes
back moves above, so that count is how far below the pool the block lay (its LRU stack distance minus
the capacity). A pool `d` blocks larger would have kept it if the distance was below `d`: a miss at
distance ratio r (distance / capacity) is a hit for a pool (1 + r) times as large. Counting every
eviction in between instead overstates the distance by the blocks that came back meanwhile (14 % too
few hits predicted for a pool twice as large on the simulator's LRU workload). A copy that no lookup
touches again (the old copy of a prompt's last block, which the engine computes again into a new block, or
a copy evicted while another stays cached) stays where it was in a larger pool: it counts as out for good.
docs/kv-events.md says where the approximation fails.

Each resident block also has a holder, its LoRA adapter and its tenant (a keyed hash of the cache
salt, exporter.sources.kvevents.tenant_of), and `HolderCounts` keeps per adapter and per tenant the
blocks resident, stored, evicted and missed for capacity: who holds the pool, and whose blocks come
back after an eviction (who loses it). `top_holders` bounds what is shown.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections import deque

from .contract import DISTANCE_BUCKETS, RESIDENCY_BUCKETS
from .sources.kvevents import CLEARED, REMOVED, STORED, BlockEvent

# The ghost list keeps every evicted block with fewer than GHOST_FACTOR x capacity blocks evicted after it
# and still out: every one whose distance can still fall in a finite bucket of the distance histogram (under
# LRU that count only grows while the block is out, as each block that comes back evicts another).
GHOST_FACTOR = math.ceil(DISTANCE_BUCKETS[-1])
# Until the pool's capacity is known (the first successful /metrics poll), the ghost list is bounded
# as if the pool were this large.
DEFAULT_CAPACITY = 65536
GPU_MEDIA = (None, "GPU")
BASE_MODEL = "base"  # the adapter label of blocks stored without a LoRA adapter
NO_TENANT = "none"  # the tenant label of blocks stored without a cache salt
OTHER = "other"  # the holders beyond the top N, summed
RESIDENT, STORED_BLOCKS, EVICTED, MISSES = range(4)  # the positions in a holder's counts


class HolderCounts:
    """Per holder (an adapter or a tenant): [resident, stored, evicted, capacity misses] in blocks.

    What a render shows stays a counter under any reranking: a holder's series counts what it gained while
    shown, and `other` what the holders beyond the top gained while not shown. A holder moving into the top
    therefore starts its series instead of taking its past out of `other` (a drop that rate() would read as a
    reset, and so as a burst the size of `other`), and one moving out takes nothing with it.
    """

    __slots__ = ("counts", "_seen", "_shown", "_other")

    def __init__(self) -> None:
        self.counts: dict[str, list[int]] = {}  # the totals, which rank the holders
        self._seen: dict[str, list[int]] = {}  # each holder's totals at the last render
        self._shown: dict[str, list[int]] = {}  # the counters each shown holder's series holds
        # What `other` holds: counters only (its resident blocks are summed afresh at each render). Holders
        # beyond the top that hold no block are forgotten, so memory stays bounded by those with blocks.
        self._other = [0, 0, 0, 0]

    def add(self, holder: str, what: int, n: int = 1) -> None:
        counts = self.counts.get(holder)
        if counts is None:
            counts = self.counts[holder] = [0, 0, 0, 0]
        counts[what] += n

    def clear_resident(self) -> None:
        for counts in self.counts.values():
            counts[RESIDENT] = 0

    def top(self, n: int) -> tuple[dict[str, list[int]], int]:
        """The n holders with the most resident blocks (ties: the most stored, then by name) and `other`
        for the rest (once there is a rest), and how many holders with blocks resident went into `other`."""
        ranked = sorted(self.counts.items(), key=lambda item: (-item[1][RESIDENT], -item[1][STORED_BLOCKS], item[0]))
        shown: dict[str, list[int]] = {}
        other_resident = folded = 0
        for place, (holder, counts) in enumerate(ranked):
            seen = self._seen.get(holder, (0, 0, 0, 0))
            gained = [now - before for now, before in zip(counts, seen)]
            if place < n:
                series = self._shown.get(holder, [0, 0, 0, 0])
                shown[holder] = [counts[RESIDENT], *(a + b for a, b in zip(series[1:], gained[1:]))]
                self._seen[holder] = list(counts)
                continue
            self._other = [0, *(a + b for a, b in zip(self._other[1:], gained[1:]))]
            if counts[RESIDENT]:
                other_resident += counts[RESIDENT]
                folded += 1
                self._seen[holder] = list(counts)
            else:
                del self.counts[holder]
                self._seen.pop(holder, None)
        self._shown = shown
        if len(ranked) > n or any(self._other[1:]):
            shown = {**shown, OTHER: [other_resident, *self._other[1:]]}
        return shown, folded


class Histogram:
    """Fixed buckets, counts per bucket (cumulated when read)."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]):
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value

    @property
    def count(self) -> int:
        return sum(self.counts)

    def cumulative(self) -> list[tuple[float, int]]:
        out, running = [], 0
        for bound, n in zip((*self.bounds, float("inf")), self.counts):
            running += n
            out.append((bound, running))
        return out


class _Marks:
    """Marks on a ring of positions with counts over ranges in O(log n) (a Fenwick tree)."""

    __slots__ = ("size", "_tree", "_marked")

    def __init__(self, size: int):
        self.size = size
        self._tree = [0] * (size + 1)
        self._marked = bytearray(size)

    def set(self, position: int, marked: bool) -> None:
        slot = position % self.size
        if self._marked[slot] == marked:
            return
        self._marked[slot] = marked
        delta, index, tree = (1 if marked else -1), slot + 1, self._tree
        while index <= self.size:
            tree[index] += delta
            index += index & -index

    def _prefix(self, slot: int) -> int:  # marks in slots 0..slot-1
        total, tree = 0, self._tree
        while slot:
            total += tree[slot]
            slot -= slot & -slot
        return total

    def count(self, first: int, last: int) -> int:
        """Marks at positions first..last (inclusive, fewer than `size` apart)."""
        low, high = first % self.size, last % self.size
        if low <= high:
            return self._prefix(high + 1) - self._prefix(low)
        return self._prefix(self.size) - self._prefix(low) + self._prefix(high + 1)


def never_a_hit(index: int, last: int) -> bool:
    """Whether the block at `index` of a store whose last block is at `last` is one the request that stored it
    would not have had as a hit from any pool: the last block of a store. An engine never counts the block that
    holds a prompt's last token as a hit, since it needs that token's logits: vLLM caps a lookup at the prompt
    length minus one (KVCacheManager.get_computed_blocks, `max_cache_hit_length`, then whole blocks only in
    find_longest_cache_hit), SGLang a match at the input length minus one (Req.adjust_max_prefix_ids, then
    whole pages in RadixCache.match_prefix). A request stores the blocks it computed, up to its last whole
    block, in one event: when its prompt ends on a block boundary, that block is the store's last. A block
    filled while decoding is stored alone and holds generated tokens, which no lookup of that request covers.
    A block followed by others in its store was followed by prompt tokens: a larger pool would have served it.
    """
    return index == last


class PoolState:
    """Resident blocks, the ghost list of evicted ones and the counters derived from them."""

    def __init__(self, capacity: int | None = None, media: tuple[str | None, ...] = GPU_MEDIA,
                 engine_lookup: bool = True):
        self.capacity: int | None = None
        self.media = media  # the `medium` of the events it folds (an offload tier's: exporter.tiers)
        # Whether a request's prefix lookup precedes its store, as in the GPU pool: never_a_hit and a request's own
        # evictions apply. An offload tier stores what the GPU pool offloads, one chunk at a time, after no lookup.
        self.engine_lookup = engine_lookup
        self.stored = 0  # blocks stored (kvcache_events_blocks_stored_total)
        self.evicted = 0  # blocks evicted; also the next eviction's ordinal
        self.capacity_misses = 0
        # Blocks stored again after an eviction that a pool of any size computes again (never_a_hit): not
        # capacity misses.
        self.recomputed = 0
        self.ignored: dict[str, int] = {"other_medium": 0, "other_group": 0}
        self.distance = Histogram(DISTANCE_BUCKETS)
        self.residency = Histogram(RESIDENCY_BUCKETS)
        self.adapters, self.tenants = HolderCounts(), HolderCounts()
        self.reset()
        self.set_capacity(capacity)

    def reset(self) -> None:
        """Forget every block (a clear, or a publisher restart: hashes of another epoch mean nothing)."""
        # hash -> store time (of its first copy); duplicates (the same content in two physical blocks) in _copies
        self.resident: dict[int, float] = {}
        self._copies: dict[int, int] = {}
        # hash -> (adapter, tenant) of resident blocks and of the ghosts (whose misses they will be)
        self.holders: dict[int, tuple[str, str]] = {}
        self._ghost_holders: dict[int, tuple[str, str]] = {}
        self.adapters.clear_resident()
        self.tenants.clear_resident()
        # The ghost list: hash -> its position in the order of evictions (the last copy's), at most
        # `_ghost_limit` of them, and the hashes in that order (the oldest at `_ghost_end - len`). Under LRU the
        # evicted blocks lie below the pool in the order they left it; a position whose block came back since
        # is marked in `_restored`. Those marks keep their place in the order until the order is compacted,
        # which it is once it holds twice the limit: memory stays within 2 x limit positions, whatever share
        # of the evicted blocks comes back. `_stale`: the positions of copies a larger pool would still hold where
        # they were, never touched again: the old copy of a block computed again (never_a_hit: the engine gives
        # the new one a block of its own whatever the pool holds) and a copy evicted while another stays cached.
        # Out for good, they count against the limit as the ghosts do.
        self.ghost: dict[int, int] = {}
        self._stale: set[int] = set()
        self._ghost_limit = GHOST_FACTOR * (self.capacity or DEFAULT_CAPACITY)
        self._ghost_end = 0
        # The evictions since the last store: the storing request's own, to make room for what its lookup did
        # not find, so made after that lookup. They lie above none of the blocks it brings back at that time.
        self._evicted_since_store = 0
        self._compact_ghost(())

    def set_capacity(self, capacity: int | None) -> None:
        if capacity is None or capacity <= 0 or int(capacity) == self.capacity:
            return
        self.capacity = int(capacity)
        self._ghost_limit = GHOST_FACTOR * self.capacity
        self._trim_ghost()
        self._compact_ghost(self._ghost_keys)  # on a ring of the new size

    def apply(self, ts: float, events: list[BlockEvent]) -> None:
        for event in events:
            if event.kind == CLEARED:
                self.reset()
                continue
            if event.medium not in self.media:
                self.ignored["other_medium"] += len(event.hashes)
                continue
            if event.group_idx:  # hybrid models: only group 0 (full attention) is the pool we size
                self.ignored["other_group"] += len(event.hashes)
                continue
            if event.kind == STORED:
                self._store(ts, event)
            elif event.kind == REMOVED:
                self._remove(ts, event.hashes)

    def _store(self, ts: float, event: BlockEvent) -> None:
        resident, ghost, holders = self.resident, self.ghost, self.holders
        hashes = event.hashes
        self.stored += len(hashes)
        adapter = event.adapter or BASE_MODEL
        tenant = event.tenant
        if tenant is None:  # vLLM salts a request's first block only: a later block is its parent's tenant's
            parent = holders.get(event.parent) if event.parent is not None else None
            tenant = parent[1] if parent is not None else NO_TENANT
        holder = (adapter, tenant)
        new = 0
        back: list[int] = []  # the positions of the capacity misses, marked once every depth is taken
        last = len(hashes) - 1
        for index, key in enumerate(hashes):
            if key in resident:
                self._copies[key] = self._copies.get(key, 1) + 1
                continue
            resident[key] = ts
            holders[key] = holder
            new += 1
            position = ghost.pop(key, None)
            if position is not None:
                self._ghost_holders.pop(key, None)
                if self.engine_lookup and (never_a_hit(index, last) or self._evicted_since_lookup(position)):
                    self.recomputed += 1
                    self._stale.add(position)
                    continue
                back.append(position)
                if self.capacity:  # as deep as at the request's lookup, before any block of it came back
                    self.distance.observe(self._depth(position) / self.capacity)
        for position in back:
            self._restored.set(position, True)
        misses = len(back)
        self.capacity_misses += misses
        self._evicted_since_store = 0
        for counts, name in ((self.adapters, adapter), (self.tenants, tenant)):
            counts.add(name, STORED_BLOCKS, len(hashes))
            counts.add(name, RESIDENT, new)
            counts.add(name, MISSES, misses)

    def _evicted_since_lookup(self, position: int) -> bool:
        """Whether the block at `position` was evicted by the storing request itself: cached at its lookup but
        not a hit (after a block that was not), so computed again at any pool size."""
        return position >= self._ghost_end - self._evicted_since_store

    def _depth(self, position: int) -> int:
        """How far below the pool's last block a ghost lay at the lookup of the request storing it again, under
        LRU: the evictions after its own, but the request's own, whose blocks have not come back since (a block
        that came back was stored above it, not below)."""
        first, last = position + 1, self._ghost_end - 1 - self._evicted_since_store
        if first > last:
            return 0
        return last - first + 1 - self._restored.count(first, last)

    def _remove(self, ts: float, hashes: list[int]) -> None:
        resident, copies, holders, ghost_holders = self.resident, self._copies, self.holders, self._ghost_holders
        gone: dict[tuple[str, str], list[int]] = {}  # holder -> [blocks evicted, blocks no longer resident]
        for key in hashes:
            self.evicted += 1
            holder = holders.get(key)
            if holder is not None:
                tally = gone.get(holder)
                if tally is None:
                    tally = gone[holder] = [0, 0]
                tally[0] += 1
            count = copies.get(key)
            if count is not None:  # another physical copy stays resident
                if count > 2:
                    copies[key] = count - 1
                else:
                    del copies[key]
                self._stale.add(self._append_evicted(key))
                continue
            stored_at = resident.pop(key, None)
            if stored_at is not None:  # else stored before the stream was joined: residency unknown
                self.residency.observe(max(0.0, ts - stored_at))
            if holder is not None:
                del holders[key]
                ghost_holders[key] = holder
                tally[1] += 1
            self.ghost[key] = self._append_evicted(key)
        for (adapter, tenant), (evicted, freed) in gone.items():
            for counts, name in ((self.adapters, adapter), (self.tenants, tenant)):
                counts.add(name, EVICTED, evicted)
                counts.add(name, RESIDENT, -freed)
        self._trim_ghost()

    def _append_evicted(self, key: int) -> int:
        """The next position in the order of evictions, for `key`."""
        position = self._ghost_end
        self._ghost_end = position + 1
        self._evicted_since_store += self.engine_lookup
        self._restored.set(position, False)  # the slot of the entry the trim drops
        self._ghost_keys.append(key)
        return position

    def _out(self, key: int, position: int) -> bool:
        """Whether the eviction at `position` is of a block still out: not stored again (and evicted again)
        since, or a stale copy."""
        return self.ghost.get(key) == position or position in self._stale

    def _trim_ghost(self) -> None:
        """Forget the oldest blocks still out beyond the limit, and the positions before the oldest one kept
        (blocks that came back: nothing counts them any more)."""
        keys, ghost, stale = self._ghost_keys, self.ghost, self._stale
        while keys:
            position = self._ghost_end - len(keys)
            oldest = keys[0]
            out = self._out(oldest, position)
            if out and len(ghost) + len(stale) <= self._ghost_limit:
                break
            keys.popleft()
            if position in stale:
                stale.discard(position)
            elif out:
                del ghost[oldest]
                self._ghost_holders.pop(oldest, None)
        if len(keys) >= 2 * self._ghost_limit:
            self._compact_ghost(keys)

    def _compact_ghost(self, keys) -> None:
        """The order of evictions with only the blocks still out, numbered from 0, and no marks."""
        ghost = self.ghost
        kept = [(key, position in self._stale) for position, key in enumerate(keys, self._ghost_end - len(keys))
                if self._out(key, position)]
        self._ghost_keys = deque(key for key, _ in kept)
        self._stale = {position for position, (_, stale) in enumerate(kept) if stale}
        for position, (key, stale) in enumerate(kept):
            if not stale:
                ghost[key] = position
        self._ghost_end = len(kept)
        self._restored = _Marks(2 * self._ghost_limit)
