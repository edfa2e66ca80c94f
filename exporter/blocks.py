"""One KV pool's state folded from its event stream: which blocks are resident, which were evicted
recently, and the capacity misses (blocks stored again after an eviction) with their distance.

Pure: no I/O, no clock; the batches' timestamps are the only time. The distance of a capacity miss is
the number of blocks the pool evicted between the block's eviction and its re-store. Under LRU a
pool `d` blocks larger would have kept the block if that distance was below `d`: a miss at distance
ratio r (distance / capacity) is a hit for a pool (1 + r) times as large. docs/kv-events.md says
where that approximation fails.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import deque

from .sources.kvevents import CLEARED, REMOVED, STORED, BlockEvent

DISTANCE_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.0, 4.0)  # distance / capacity; the contract's buckets
RESIDENCY_BUCKETS = (1.0, 5.0, 15.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0)  # seconds
# The ghost list keeps the last GHOST_FACTOR x capacity evictions: enough for every finite bucket of
# the distance histogram (the largest is 4 x capacity).
GHOST_FACTOR = 4
# Until the pool's capacity is known (the first successful /metrics poll), the ghost list is bounded
# as if the pool were this large.
DEFAULT_CAPACITY = 65536
GPU_MEDIA = (None, "GPU")


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


class PoolState:
    """Resident blocks, the ghost list of evicted ones and the counters derived from them."""

    def __init__(self, capacity: int | None = None):
        self.capacity: int | None = None
        self.stored = 0  # blocks stored (kvcache_events_blocks_stored_total)
        self.evicted = 0  # blocks evicted; also the next eviction's ordinal
        self.capacity_misses = 0
        self.ignored: dict[str, int] = {"other_medium": 0, "other_group": 0}
        self.distance = Histogram(DISTANCE_BUCKETS)
        self.residency = Histogram(RESIDENCY_BUCKETS)
        self.reset()
        self.set_capacity(capacity)

    def reset(self) -> None:
        """Forget every block (a clear, or a publisher restart: hashes of another epoch mean nothing)."""
        # hash -> store time (of its first copy); duplicates (the same content in two physical blocks) in _copies
        self.resident: dict[int, float] = {}
        self._copies: dict[int, int] = {}
        # hash -> ordinal of its eviction, and the evicted hashes in eviction order to bound it
        self.ghost: dict[int, int] = {}
        self._ghost_keys: deque[int] = deque()
        self._ghost_ordinals: deque[int] = deque()

    def set_capacity(self, capacity: int | None) -> None:
        if capacity is not None and capacity > 0:
            self.capacity = int(capacity)
        self._ghost_limit = GHOST_FACTOR * (self.capacity or DEFAULT_CAPACITY)
        self._trim_ghost()

    def apply(self, ts: float, events: list[BlockEvent]) -> None:
        for event in events:
            if event.kind == CLEARED:
                self.reset()
                continue
            if event.medium not in GPU_MEDIA:
                self.ignored["other_medium"] += len(event.hashes)
                continue
            if event.group_idx:  # hybrid models: only group 0 (full attention) is the pool we size
                self.ignored["other_group"] += len(event.hashes)
                continue
            if event.kind == STORED:
                self._store(ts, event.hashes)
            elif event.kind == REMOVED:
                self._remove(ts, event.hashes)

    def _store(self, ts: float, hashes: list[int]) -> None:
        resident, ghost = self.resident, self.ghost
        self.stored += len(hashes)
        for key in hashes:
            if key in resident:
                self._copies[key] = self._copies.get(key, 1) + 1
                continue
            resident[key] = ts
            ordinal = ghost.pop(key, None)
            if ordinal is not None:
                self.capacity_misses += 1
                if self.capacity:
                    self.distance.observe((self.evicted - ordinal - 1) / self.capacity)

    def _remove(self, ts: float, hashes: list[int]) -> None:
        resident, copies = self.resident, self._copies
        for key in hashes:
            self.evicted += 1
            count = copies.get(key)
            if count is not None:  # another physical copy stays resident
                if count > 2:
                    copies[key] = count - 1
                else:
                    del copies[key]
                continue
            stored_at = resident.pop(key, None)
            if stored_at is not None:  # else stored before the stream was joined: residency unknown
                self.residency.observe(max(0.0, ts - stored_at))
            ordinal = self.ghost[key] = self.evicted - 1
            self._ghost_keys.append(key)
            self._ghost_ordinals.append(ordinal)
        self._trim_ghost()

    def _trim_ghost(self) -> None:
        keys, ordinals, ghost = self._ghost_keys, self._ghost_ordinals, self.ghost
        while len(keys) > self._ghost_limit:
            oldest, ordinal = keys.popleft(), ordinals.popleft()
            if ghost.get(oldest) == ordinal:  # not re-stored (and evicted again) since
                del ghost[oldest]
