"""The offload tiers beside a GPU pool, folded from the pool's own KV event stream: the blocks each tier holds,
its capacity misses with their distance (one exporter.blocks.PoolState per tier), and the GPU pool's stores
each tier served.

The engines publish a tier's blocks in the GPU pool's batches, told apart by `medium`: vLLM's offloading
connector stores and evictions in CPU memory as "CPU" (vllm/distributed/kv_transfer/kv_connector/v1/offloading/
events.py, OffloadingEventsTracker.take_events: one store per chunk offloaded, one removal per chunk its CPU
manager evicts), SGLang's HiCache its host copies as "CPU_PINNED" (and its disk and remote pools as "DISK" and
"EXTERNAL"). Both tiers evict least recently used first (vLLM's CPU manager by default, SGLang's host pool),
so the model of exporter.blocks holds there as in the GPU pool: a block stored to a tier again while it is on
the tier's list of evictions was evicted from the tier, computed again on the GPU and offloaded again, a
capacity miss of the tier; a tier (1 + r) times as large would have served it, r its distance ratio (the
tier's evictions after it and still out, over the tier's capacity in blocks).

Served: a block the GPU pool stores while a tier holds it was loaded from that tier (an offload hit), not
computed. vLLM caches the blocks a load brought in once it is done (v1/core/sched/scheduler.py,
_update_waiting_for_remote_kv) and SGLang stores a node it loads back from host memory, while a block the GPU
computes is offloaded after its store, never before. So the served count is the offload hits by the tier that
served them, in blocks. Not counted as served: a block the GPU pool already holds (vLLM's second copy of a
prompt's last block, which it computes again whatever the tiers hold).

Pure: no I/O, no clock, as exporter.blocks.
"""

from __future__ import annotations

from .blocks import GPU_MEDIA, PoolState
from .sources.kvevents import STORED, BlockEvent

# The media the engines name for each offload tier (contract.TIERS): vLLM "CPU" and "STORAGE", SGLang
# "CPU_PINNED", "DISK" and "EXTERNAL". Any other medium is left to the GPU pool, which counts it as ignored.
TIER_MEDIA = {"cpu": ("CPU", "CPU_PINNED"), "disk": ("DISK", "STORAGE"), "remote": ("EXTERNAL",)}
TIER_OF_MEDIUM = {medium: tier for tier, media in TIER_MEDIA.items() for medium in media}


class Tiers:
    """The offload tiers of one GPU pool, each created by its first event."""

    def __init__(self) -> None:
        self.pools: dict[str, PoolState] = {}
        self.served: dict[str, int] = {}  # blocks the GPU pool stored while the tier held them, by tier
        self.block_size: int | None = None  # tokens per block of the GPU pool's last store that named it

    def reset(self) -> None:
        """Forget every tier's blocks (a publisher restart)."""
        for pool in self.pools.values():
            pool.reset()

    def set_capacity(self, tier: str, blocks: float | None) -> None:
        pool = self.pools.get(tier)
        if pool is not None:
            pool.set_capacity(blocks)

    def apply(self, gpu: PoolState, ts: float, events: list[BlockEvent]) -> None:
        """Fold a batch into the GPU pool and the tiers, in the batch's order."""
        self._note_block_size(events)
        if not self.pools and {event.medium for event in events}.issubset(GPU_MEDIA):
            gpu.apply(ts, events)  # no tier yet: the GPU pool's events alone, as without tiers
            return
        run: list[BlockEvent] = []  # consecutive events of one pool
        run_tier: str | None = None  # None: the GPU pool's
        for event in events:
            tier = TIER_OF_MEDIUM.get(event.medium)  # None: the GPU pool's, or a medium it counts as ignored
            gpu_store = event.kind == STORED and event.medium in GPU_MEDIA and not event.group_idx
            if tier != run_tier or (gpu_store and self._holds_any(event.hashes)):
                self._flush(gpu, run_tier, ts, run)  # the GPU pool up to date before a store is checked
                run, run_tier = [], tier
                if gpu_store:
                    self._count_served(gpu, event.hashes)
            run.append(event)
        self._flush(gpu, run_tier, ts, run)

    def _flush(self, gpu: PoolState, tier: str | None, ts: float, run: list[BlockEvent]) -> None:
        if not run:
            return
        if tier is None:
            gpu.apply(ts, run)
            return
        pool = self.pools.get(tier)
        if pool is None:
            pool = self.pools[tier] = PoolState(media=TIER_MEDIA[tier], engine_lookup=False)
            self.served[tier] = 0
        pool.apply(ts, run)

    def _holds_any(self, hashes: list[int]) -> bool:
        return any(key in pool.resident for pool in self.pools.values() for key in hashes)

    def _count_served(self, gpu: PoolState, hashes: list[int]) -> None:
        """A block new to the GPU pool that a tier holds came from that tier (the nearest, where several do)."""
        resident = gpu.resident
        for key in dict.fromkeys(hashes):
            if key in resident:
                continue
            for tier in TIER_MEDIA:
                pool = self.pools.get(tier)
                if pool is not None and key in pool.resident:
                    self.served[tier] += 1
                    break

    def _note_block_size(self, events: list[BlockEvent]) -> None:
        for event in reversed(events):
            if event.kind == STORED and event.medium in GPU_MEDIA and not event.group_idx and event.block_size:
                self.block_size = event.block_size
                return
