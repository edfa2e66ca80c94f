"""A discrete-time model of one continuous-batching LLM server with a paged KV pool.

Pure and deterministic: no threads, no I/O, no wall clock, no randomness. `EngineModel` is a
function of the requests submitted to it (`workload.ArrivalProcess` draws those, seeded).

- KV pool (`BlockPool`): `num_blocks` blocks of `block_size` tokens. A block is free, held by
  running requests (ref-counted when shared), or cached-evictable: its content is kept for
  prefix reuse but nobody holds it, so it counts as free and is evicted least-recently-used
  first, as in vLLM and SGLang.
- Prefix cache: full blocks get a content key. Blocks that lie wholly inside one of the shared
  prefixes get the same key in every request, so a later request reuses them; other blocks are
  keyed per request (a preempted request can find its own blocks again). As in vLLM, a block is
  cached when the chunk that fills it is scheduled, so a request admitted later in the same step
  finds it.
- Scheduler (vLLM V1-like, FCFS): each step first gives every running request its next chunk
  (prefill chunks or one decode token) within the token budget `max_num_batched_tokens`; a
  running request that needs a block while the pool (free + evictable) is empty preempts the
  most recently admitted request (freeing all its blocks; it recomputes later from the front
  of the queue). Only in a step without preemption does the head of the waiting queue get
  admitted, and only when the running cap `max_num_seqs` allows and all blocks of its prompt fit
  next to a reserve for the output still to come: `reserve_ratio` x the remaining output tokens
  of the running requests and the candidate. Like SGLang's `new_token_ratio`, the scheduler
  grows bolder under pressure: the ratio starts at `reserve_ratio_init`, falls to
  `reserve_ratio_min` over `reserve_decay_steps` steps in which the queue head waits for KV, and
  returns to `reserve_ratio_init` once the queue is empty. So a filling pool first queues
  requests, and preemptions follow once the reserve has worn thin.
  (`reserve_ratio_init: 0` gives vLLM V1's reserve-free admission.)
- Offload tier (optional, `offload_blocks` > 0; `OffloadTier`): a CPU tier behind the pool. A cached
  block the pool evicts is stored there (GPU to CPU at `offload_store_bytes_per_s`); the tier evicts
  least-recently-used first. At admission the prefix lookup goes on in the tier where the pool's
  cached head ends: those blocks are loaded back (CPU to GPU at `offload_load_bytes_per_s`, the load
  time added to the step) instead of recomputed, and counted as hits from the CPU. A block is
  `kv_bytes_per_token` x `block_size` bytes. Loads finish within their step. Stores are asynchronous,
  one batch after another over one link, as vLLM's native offload does them: each step's evicted
  blocks are one allocation in the tier, and until a block's store completes it is pinned (neither
  loaded nor evicted). An allocation evicts only unpinned blocks; when those are too few it stores
  nothing and counts an allocation failure (vLLM's `prepare_store` returning None). At the default
  bandwidth a store ends within its step, so the tier never refuses while it has any block to evict.
- Time: a step lasts `step_base_s + step_per_token_s * tokens_in_step` (+ the step's load-back time);
  TTFT, ITL, queue time and end-to-end latency are read off this simulated clock.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections import OrderedDict, deque
from itertools import islice
from dataclasses import dataclass, field, replace
from typing import Hashable

BlockKey = Hashable
STORED, REMOVED = "stored", "removed"
# The offload tier's entries in the pool's journal (its KV events, medium CPU).
TIER_STORED, TIER_REMOVED = "tier stored", "tier removed"


@dataclass(frozen=True)
class EngineConfig:
    num_blocks: int = 1024  # usable KV blocks (vLLM reports one more: the null block)
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 8192
    enable_prefix_caching: bool = True
    step_base_s: float = 0.02
    step_per_token_s: float = 0.00005
    reserve_ratio_init: float = 0.5
    reserve_ratio_min: float = 0.05
    reserve_decay_steps: int = 3000
    offload_blocks: int = 0  # CPU offload tier size in blocks; 0: no tier
    offload_load_bytes_per_s: float = 20e9  # CPU to GPU
    offload_store_bytes_per_s: float = 20e9  # GPU to CPU
    kv_bytes_per_token: int = 131072  # what a block's transfer moves per token (Llama-3.1-8B in bf16)

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def block_bytes(self) -> int:
        return self.block_size * self.kv_bytes_per_token

    @property
    def effective_max_model_len(self) -> int:
        # A sequence longer than the pool could never finish, so no request may exceed it.
        return min(self.max_model_len, self.capacity_tokens)


@dataclass(frozen=True)
class HistogramBuckets:
    ttft: tuple[float, ...]
    itl: tuple[float, ...]
    e2e: tuple[float, ...]
    queue: tuple[float, ...]
    iteration_tokens: tuple[float, ...] = ()
    offload_transfer: tuple[float, ...] = ()  # one observation per step's load-back or store batch


@dataclass(frozen=True)
class Reporting:
    """How an engine reports: histogram buckets and when gauges and queue time are recorded."""

    buckets: HistogramBuckets
    queue_time_at_finish: bool  # vLLM observes queue time when a request finishes; SGLang at first scheduling
    report_every_decode_steps: int = 1  # gauges refresh on prefill steps and every N decode steps
    report_idle_s: float = 30.0  # ... and after this long idle
    # TensorRT-LLM's iteration-stats loop wakes when a request finishes: only then do gauges refresh
    # (not on prefill, not when idle).
    report_when_requests_finish: bool = False


class Histogram:
    """Cumulative-on-read histogram with fixed upper bounds (+Inf implied)."""

    __slots__ = ("bounds", "counts", "sum", "count")

    def __init__(self, bounds: tuple[float, ...]):
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def cumulative(self) -> list[tuple[float, int]]:
        """(upper bound, cumulative count) pairs, ending with (inf, count)."""
        out, running = [], 0
        for bound, n in zip((*self.bounds, math.inf), self.counts):
            running += n
            out.append((bound, running))
        return out

    def copy(self) -> "Histogram":
        other = Histogram(self.bounds)
        other.counts = list(self.counts)
        other.sum, other.count = self.sum, self.count
        return other

    @staticmethod
    def merged(histograms: list["Histogram"]) -> "Histogram":
        """The sum of histograms with the same bounds (at least one)."""
        total = histograms[0].copy()
        for other in histograms[1:]:
            total.counts = [a + b for a, b in zip(total.counts, other.counts)]
            total.sum += other.sum
            total.count += other.count
        return total


@dataclass
class Counters:
    preemptions: int = 0  # when they happen (SGLang counts retractions so)
    preemptions_rescheduled: int = 0  # when the preempted request is scheduled again (vLLM counts so)
    retracted_input_tokens: int = 0
    retracted_output_tokens: int = 0
    prefix_queried_tokens: int = 0  # prompt tokens looked up at first admission
    prefix_hit_tokens: int = 0
    prompt_tokens: int = 0  # when the prefill completes
    generation_tokens: int = 0
    finished_requests: int = 0
    # Per finished request (SGLang's tokenizer counters).
    finished_prompt_tokens: int = 0
    finished_generation_tokens: int = 0
    finished_cached_tokens: int = 0
    # Tokens processed per step by kind (SGLang's realtime_tokens_total).
    prefill_compute_tokens: int = 0
    prefill_cache_tokens: int = 0
    decode_tokens: int = 0
    # The offload tier.
    offload_queried_tokens: int = 0  # prompt tokens looked up in the tier (beyond the pool's hits), first admission
    offload_hit_tokens: int = 0  # of those, found in the tier
    finished_offload_cached_tokens: int = 0  # tier hits of finished requests (SGLang's cache_source="host")
    offload_loaded_blocks: int = 0
    offload_stored_blocks: int = 0
    offload_evicted_blocks: int = 0
    offload_store_failures: int = 0  # allocations the tier refused: too few unpinned blocks to evict
    offload_load_seconds: float = 0.0
    offload_store_seconds: float = 0.0


# The queue reasons (EngineModel.waiting_reason) of a queue KV holds back.
KV_BOUND = ("kv", "freed")


@dataclass(frozen=True)
class GaugeReport:
    """Scheduler gauges as last reported."""

    running: int
    waiting: int
    paused: int  # waiting requests that had been running: preempted, to resume (TensorRT-LLM's "paused")
    used_blocks: int
    evictable_blocks: int
    free_blocks: int
    waiting_reason: str | None
    prefill_hit_ratio: float  # hit share of the last prefill batch; 0 on decode-only reports
    generation_throughput: float  # tokens/s since the previous report
    preemptions_since_last: int


class Request:
    __slots__ = (
        "id", "arrival", "prompt_len", "output_len", "prefix_id", "prefix_len",
        "generated", "computed", "blocks", "hit_tokens", "offload_hit_tokens", "first_scheduled",
        "last_token_time", "preempted_unreported",
    )

    def __init__(self, rid: int, arrival: float, prompt_len: int, output_len: int,
                 prefix_id: int | None = None, prefix_len: int = 0):
        self.id = rid
        self.arrival = arrival
        self.prompt_len = prompt_len
        self.output_len = output_len
        self.prefix_id = prefix_id
        self.prefix_len = prefix_len if prefix_id is not None else 0
        self.generated = 0
        self.computed = 0  # tokens whose KV is in the pool
        self.blocks: list[BlockKey | None] = []  # None: held but without a content key
        self.hit_tokens = 0  # all cached tokens at first admission, the tier's included
        self.offload_hit_tokens = 0
        self.first_scheduled: float | None = None
        self.last_token_time = 0.0
        self.preempted_unreported = False

    @property
    def target(self) -> int:
        """Tokens whose KV must be computed before the next token comes out."""
        return self.prompt_len + self.generated

    @property
    def output_to_come(self) -> int:
        """Tokens it will still generate: what an admission reserve keeps KV back for."""
        return self.output_len - self.generated

    def block_key(self, index: int, block_size: int) -> BlockKey:
        if (index + 1) * block_size <= self.prefix_len:
            return ("prefix", self.prefix_id, index)
        return (self.id, index)

    @property
    def owner(self) -> int:
        """Whose blocks these are (their adapter and cache salt: simulator.workload.holder): a prefixed
        request's are its prefix's, as a salted prompt shares blocks only within its tenant."""
        return self.prefix_id if self.prefix_id is not None else self.id


class OffloadTier:
    """The CPU tier, kept as vLLM's LRU offloading manager keeps it: block keys, least recently used first,
    each with the time its store completes (a block is pinned until then)."""

    def __init__(self, capacity: int, store_seconds_per_block: float):
        self.capacity = capacity
        self.store_seconds_per_block = store_seconds_per_block
        self.blocks: OrderedDict[BlockKey, float] = OrderedDict()  # key -> when its store completes
        self.link_free_at = 0.0  # when the stores queued so far are done

    def is_ready(self, key: BlockKey, now: float) -> bool:
        done = self.blocks.get(key)
        return done is not None and done <= now

    def pinned(self, now: float) -> int:
        return sum(1 for done in self.blocks.values() if done > now)

    def store(self, keys: list[BlockKey], now: float, journal: list | None = None) -> tuple[int, int] | None:
        """One allocation for the blocks of `keys` (those already kept become most recently used): room is
        made by evicting unpinned blocks outside `keys`, least recently used first; when that cannot make
        enough, nothing is stored or evicted and the answer is None. Else (blocks stored, blocks evicted).
        The evictions and stores go to `journal` (the pool's, when it records KV events)."""
        new = [key for key in keys if key not in self.blocks]
        excess = len(self.blocks) + len(new) - self.capacity
        victims: list[BlockKey] = []
        if excess > 0:
            wanted = set(keys)
            victims = list(islice((key for key, done in self.blocks.items() if done <= now and key not in wanted),
                                  excess))
            if len(victims) < excess:
                return None
        for key in victims:
            del self.blocks[key]
        if journal is not None:
            journal.extend((TIER_REMOVED, key) for key in victims)
            journal.extend((TIER_STORED, key) for key in new)
        for key in keys:
            if key in self.blocks:
                self.blocks.move_to_end(key)
        if new:
            self.link_free_at = max(now, self.link_free_at) + len(new) * self.store_seconds_per_block
            for key in new:
                self.blocks[key] = self.link_free_at
        return len(new), len(victims)

    def touch(self, key: BlockKey) -> None:
        self.blocks.move_to_end(key)


class BlockPool:
    """Paged KV pool: used (held) + evictable + free == capacity at all times."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.spilled: list[BlockKey] = []  # cached blocks evicted since the owner last took them
        # In order, as an engine's prefix cache announces them: (STORED, key, the key of the block before it in
        # its request, or None for a request's first block, the request's owner) or (REMOVED, key); None: not kept
        self.journal: list[tuple] | None = None
        self.free = capacity
        self.anonymous = 0  # held blocks without a content key (partial, or duplicate content)
        self.held: dict[BlockKey, int] = {}  # keyed held block -> reference count
        self.evictable: OrderedDict[BlockKey, None] = OrderedDict()  # least recently used first

    @property
    def used(self) -> int:
        return self.anonymous + len(self.held)

    @property
    def available(self) -> int:
        return self.free + len(self.evictable)

    def is_cached(self, key: BlockKey) -> bool:
        return key in self.held or key in self.evictable

    def acquire_cached(self, key: BlockKey) -> None:
        if key in self.evictable:
            del self.evictable[key]
            self.held[key] = 1
        else:
            self.held[key] += 1

    def allocate(self) -> bool:
        """Take an empty block, evicting the least recently used cached one if needed."""
        if self.free:
            self.free -= 1
        elif self.evictable:
            key, _ = self.evictable.popitem(last=False)
            self.spilled.append(key)
            if self.journal is not None:  # as vLLM: an eviction is announced when the block is reallocated
                self.journal.append((REMOVED, key))
        else:
            return False
        self.anonymous += 1
        return True

    def seal(self, key: BlockKey, parent: BlockKey | None = None, owner: int | None = None) -> bool:
        """Give a freshly filled anonymous block its content key, unless that content is already cached;
        `parent` and `owner` go to the journal."""
        if self.is_cached(key):
            return False
        self.anonymous -= 1
        self.held[key] = 1
        if self.journal is not None:
            self.journal.append((STORED, key, parent, owner))
        return True

    def release(self, key: BlockKey | None) -> None:
        if key is None:
            self.anonymous -= 1
            self.free += 1
            return
        refs = self.held[key] - 1
        if refs:
            self.held[key] = refs
        else:
            del self.held[key]
            self.evictable[key] = None


@dataclass
class StepEvents:
    """What one scheduler step did, for observers such as the invariant tests."""

    available_at_preemption: list[int] = field(default_factory=list)
    admitted: list[int] = field(default_factory=list)
    readmitted: list[int] = field(default_factory=list)
    finished: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class ModelSnapshot:
    config: EngineConfig
    started_at: float
    now: float
    report: GaugeReport
    counters: Counters
    histograms: dict[str, Histogram]
    offload_used_blocks: int = 0  # blocks the tier holds
    offload_pinned_blocks: int = 0  # of those, blocks whose store is still in flight (not evictable)
    deferred: int = 0  # waiting requests held by their KV transfer, not by capacity (vLLM's `deferred` reason)


class EngineModel:
    def __init__(self, config: EngineConfig, reporting: Reporting, start_time: float = 0.0,
                 record_kv_events: bool = False):
        self.config = config
        self.reporting = reporting
        self.started_at = start_time
        self.now = start_time
        self.pool = BlockPool(config.num_blocks)
        self.tier = (OffloadTier(config.offload_blocks, config.block_bytes / config.offload_store_bytes_per_s)
                     if config.offload_blocks else None)
        self._load_seconds = 0.0  # load-back time of the step being built
        # With record_kv_events: (end of step, the pool's journal of that step) for each step that stored
        # or evicted a block, as the engines publish one KV event batch per scheduler step.
        self.kv_batches: list[tuple[float, list]] | None = [] if record_kv_events else None
        if record_kv_events:
            self.pool.journal = []
        self.running: list[Request] = []
        self.waiting: deque[Request] = deque()
        # Why the head of the queue waits, as the engine stands after its last step: "kv", "cap" or "budget"
        # as that step's admission found it, or "freed" where KV held the head back at admission and
        # requests finishing in the step freed room for it: it goes in at the next step, and until then
        # the page shows a queue beside free blocks (for TensorRT-LLM, whose gauges refresh only when a
        # request finishes, until the next finish).
        self.waiting_reason: str | None = None
        # Wedged (a scenario phase's `wedged: true`): the scheduler admits nothing; the running batch runs out and
        # requests keep queueing, while the page goes on being served ("wedged" is then the queue's reason).
        self.wedged = False
        self.reserve_ratio = config.reserve_ratio_init
        self._inbox: deque[Request] = deque()
        self.counters = Counters()
        buckets = reporting.buckets
        self.histograms = {
            "ttft": Histogram(buckets.ttft),
            "itl": Histogram(buckets.itl),
            "e2e": Histogram(buckets.e2e),
            "queue": Histogram(buckets.queue),
            "iteration_tokens": Histogram(buckets.iteration_tokens),
            "offload_load": Histogram(buckets.offload_transfer),
            "offload_store": Histogram(buckets.offload_transfer),
        }
        self._decode_steps_since_report = 0
        self._tokens_since_report = 0
        self._preemptions_at_report = 0
        self._report_time = start_time
        self.report = self._make_report(prefill_hit_ratio=0.0)

    # -- driving ---------------------------------------------------------------------------

    def submit(self, request: Request) -> None:
        """Queue a request that arrives at `request.arrival` (submit in arrival order)."""
        self._inbox.append(request)

    def advance_to(self, t: float, on_step=None) -> None:
        """Run steps until the clock reaches `t` (the last step may end after it)."""
        while self.now < t:
            events = self.step(until=t)
            if on_step is not None and events is not None:
                on_step(self, events)

    def step(self, until: float = math.inf) -> StepEvents | None:
        """One scheduler iteration, or an idle jump (to the next arrival or `until`) returning None."""
        while self._inbox and self._inbox[0].arrival <= self.now:
            self.waiting.append(self._inbox.popleft())
        if self.wedged:
            self.waiting_reason = "wedged" if self.waiting else None
        if not self.running and (not self.waiting or self.wedged):
            self._idle(min(self._inbox[0].arrival if self._inbox else until, until))
            return None

        events = StepEvents()
        budget = self.config.max_num_batched_tokens
        batch: list[tuple[Request, int]] = []
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            chunk = min(request.target - request.computed, budget)
            if not self._reserve_blocks(request, request.computed + chunk, events):
                break  # it was the last running request and preempted itself
            self._schedule(batch, request, chunk)
            budget -= chunk
            index += 1
        if self.wedged:
            pass  # admits nothing: the queue's reason stays "wedged"
        elif events.available_at_preemption:
            # As vLLM: a step that had to preempt schedules nothing new.
            self.waiting_reason = "kv" if self.waiting else None
        else:
            self.waiting_reason = self._admit(batch, budget, events)
        self._update_reserve_ratio()
        self._execute(batch, events)
        if self.pool.journal:
            self.kv_batches.append((self.now, self.pool.journal))
            self.pool.journal = []
        return events

    def _idle(self, until: float) -> None:
        refresh_at = self._report_time + self.reporting.report_idle_s
        if refresh_at <= until:
            self.now = max(self.now, refresh_at)
            self.report = self._make_report(prefill_hit_ratio=0.0)
        else:
            self.now = max(self.now, until)

    # -- scheduling ------------------------------------------------------------------------

    def _blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.config.block_size)

    def _reserve_blocks(self, request: Request, tokens: int, events: StepEvents) -> bool:
        """Make `request` hold blocks for `tokens` tokens, preempting from the back if the pool is empty."""
        missing = self._blocks_for(tokens) - len(request.blocks)
        while missing > 0:
            if self.pool.allocate():
                request.blocks.append(None)
                missing -= 1
                continue
            victim = self.running.pop()
            self._preempt(victim, events)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request, events: StepEvents) -> None:
        events.available_at_preemption.append(self.pool.available)
        counters = self.counters
        counters.preemptions += 1
        counters.retracted_input_tokens += request.prompt_len
        counters.retracted_output_tokens += request.generated
        self._release_all(request)
        request.computed = 0
        request.preempted_unreported = True
        self.waiting.appendleft(request)

    def _release_all(self, request: Request) -> None:
        # Tail blocks first, so that they are evicted before the request's (shareable) head.
        for key in reversed(request.blocks):
            self.pool.release(key)
        request.blocks = []

    def _cached_head(self, request: Request) -> tuple[list[BlockKey], list[BlockKey]]:
        """Keys of the leading blocks cached in the pool, then of those that follow in the offload tier;
        at least one token is always left to compute."""
        if not self.config.enable_prefix_caching:
            return [], []
        self._spill()  # blocks evicted earlier in this step are in the tier by now
        size = self.config.block_size
        keys: list[BlockKey] = []
        offloaded: list[BlockKey] = []
        for index in range((request.target - 1) // size):
            key = request.block_key(index, size)
            if not offloaded and self.pool.is_cached(key):
                keys.append(key)
            elif self.tier is not None and self.tier.is_ready(key, self.now):
                offloaded.append(key)
            else:
                break
        return keys, offloaded

    def _update_reserve_ratio(self) -> None:
        config = self.config
        if not self.waiting:
            self.reserve_ratio = config.reserve_ratio_init
        elif self.waiting_reason == "kv":
            step = (config.reserve_ratio_init - config.reserve_ratio_min) / config.reserve_decay_steps
            self.reserve_ratio = max(config.reserve_ratio_min, self.reserve_ratio - step)

    def _admit(self, batch: list[tuple[Request, int]], budget: int, events: StepEvents) -> str | None:
        """Admit from the head of the queue (FCFS); return why the head still waits, if it does."""
        pool, config = self.pool, self.config
        if not self.waiting:
            return None
        output_to_come = self._running_output_to_come()
        while self.waiting:
            if budget <= 0:
                return "budget"
            if len(self.running) >= config.max_num_seqs:
                return "cap"
            request = self.waiting[0]
            output_to_come += request.output_to_come
            fit = self._fit(request, output_to_come)
            if fit is None:
                return "kv"
            hits, offloaded, missing = fit
            self.waiting.popleft()
            for key in hits:
                pool.acquire_cached(key)
            for _ in range(missing):
                pool.allocate()
            request.blocks = hits + [None] * missing
            self._load_back(request, len(hits), offloaded)
            hit_tokens = (len(hits) + len(offloaded)) * config.block_size
            request.computed = hit_tokens
            self.counters.prefill_cache_tokens += hit_tokens
            if request.first_scheduled is None:
                self._first_admission(request, hit_tokens, len(offloaded) * config.block_size)
                events.admitted.append(request.id)
            else:
                if request.preempted_unreported:
                    self.counters.preemptions_rescheduled += 1
                    request.preempted_unreported = False
                events.readmitted.append(request.id)
            self.running.append(request)
            chunk = min(request.target - request.computed, budget)
            self._schedule(batch, request, chunk)
            budget -= chunk
        return None

    def _running_output_to_come(self) -> int:
        return sum(r.output_to_come for r in self.running)

    def _fit(self, request: Request, output_to_come: int) -> tuple[list[BlockKey], list[BlockKey], int] | None:
        """The blocks `request` would take (cached in the pool, in the tier, newly allocated) if it fits beside
        the decode reserve for `output_to_come` tokens (its own included); None where KV holds it back."""
        hits, offloaded = self._cached_head(request)
        missing = self._blocks_for(request.target) - len(hits)
        hits_now_evictable = sum(1 for key in hits if key in self.pool.evictable)
        reserve = self._blocks_for(math.ceil(self.reserve_ratio * output_to_come)) if self.running else 0
        if missing + reserve > self.pool.available - hits_now_evictable:
            return None
        return hits, offloaded, missing

    def _load_back(self, request: Request, first: int, offloaded: list[BlockKey]) -> None:
        """Fill the request's blocks `first`... with the tier's copies of `offloaded` (freshly allocated,
        so the pool's blocks are anonymous until sealed here) and count the transfer."""
        if not offloaded:
            return
        size = self.config.block_size
        for index, key in enumerate(offloaded, first):
            self.tier.touch(key)
            if self.pool.seal(key, request.block_key(index - 1, size) if index else None, request.owner):
                request.blocks[index] = key
        counters, config = self.counters, self.config
        seconds = len(offloaded) * config.block_bytes / config.offload_load_bytes_per_s
        counters.offload_loaded_blocks += len(offloaded)
        counters.offload_load_seconds += seconds
        self._load_seconds += seconds
        self.histograms["offload_load"].observe(seconds)

    def _spill(self) -> None:
        """Store the blocks the pool evicted in the tier, as one allocation (or forget them without a tier)."""
        spilled, self.pool.spilled = self.pool.spilled, []
        if self.tier is None or not spilled:
            return
        counters = self.counters
        outcome = self.tier.store(spilled, self.now, self.pool.journal)
        if outcome is None:
            counters.offload_store_failures += 1
            return
        stored, evicted = outcome
        counters.offload_evicted_blocks += evicted
        if stored:
            seconds = stored * self.tier.store_seconds_per_block
            counters.offload_stored_blocks += stored
            counters.offload_store_seconds += seconds
            self.histograms["offload_store"].observe(seconds)

    def _first_admission(self, request: Request, hit_tokens: int, offload_hit_tokens: int) -> None:
        request.first_scheduled = self.now
        request.hit_tokens = hit_tokens
        request.offload_hit_tokens = offload_hit_tokens
        if self.config.enable_prefix_caching:
            self.counters.prefix_queried_tokens += request.prompt_len
            self.counters.prefix_hit_tokens += hit_tokens - offload_hit_tokens
            if self.tier is not None:
                self.counters.offload_queried_tokens += request.prompt_len - (hit_tokens - offload_hit_tokens)
                self.counters.offload_hit_tokens += offload_hit_tokens
        if not self.reporting.queue_time_at_finish:
            self.histograms["queue"].observe(self.now - request.arrival)

    # -- execution -------------------------------------------------------------------------

    def _execute(self, batch: list[tuple[Request, int]], events: StepEvents) -> None:
        config, counters = self.config, self.counters
        tokens = sum(chunk for _, chunk in batch)
        end = self.now + config.step_base_s + config.step_per_token_s * tokens + self._load_seconds
        self._load_seconds = 0.0
        self._spill()
        prefill_tokens = 0
        prefill_hits = 0
        finished = False
        for request, chunk in batch:
            before = request.computed
            request.computed = before + chunk
            if request.generated and request.target - before == 1:
                counters.decode_tokens += 1
            else:
                prefill_tokens += chunk
                if before == request.hit_tokens and request.generated == 0:
                    prefill_hits += before
            if request.computed == request.target:
                finished |= self._emit_token(request, end, events)
        counters.prefill_compute_tokens += prefill_tokens
        if finished:
            self.running = [r for r in self.running if r.generated < r.output_len]
        self.histograms["iteration_tokens"].observe(tokens)
        self.now = end
        if finished and self.waiting_reason == "kv" and not events.available_at_preemption:
            head = self.waiting[0]
            if self._fit(head, self._running_output_to_come() + head.output_to_come) is not None:
                self.waiting_reason = "freed"
        self._after_step(prefill_tokens, prefill_hits, finished)

    def _schedule(self, batch: list[tuple[Request, int]], request: Request, chunk: int) -> None:
        """Put `chunk` tokens of `request` in the step's batch. As vLLM's allocate_slots, the blocks the chunk
        fills are cached when scheduled, not once computed: a request admitted later in the same step finds them."""
        batch.append((request, chunk))
        if self.config.enable_prefix_caching:
            self._seal_full_blocks(request, request.computed, request.computed + chunk)

    def _seal_full_blocks(self, request: Request, start: int, end: int) -> None:
        size = self.config.block_size
        for index in range(start // size, end // size):
            if request.blocks[index] is None:
                key = request.block_key(index, size)
                if self.pool.seal(key, request.block_key(index - 1, size) if index else None, request.owner):
                    request.blocks[index] = key

    def _emit_token(self, request: Request, now: float, events: StepEvents) -> bool:
        """Record one output token of `request` at `now`; return True if the request finished."""
        counters, histograms = self.counters, self.histograms
        request.generated += 1
        counters.generation_tokens += 1
        self._tokens_since_report += 1
        if request.generated == 1:
            histograms["ttft"].observe(now - request.arrival)
            counters.prompt_tokens += request.prompt_len
        else:
            histograms["itl"].observe(now - request.last_token_time)
        request.last_token_time = now
        if request.generated < request.output_len:
            return False
        self._release_all(request)
        histograms["e2e"].observe(now - request.arrival)
        if self.reporting.queue_time_at_finish:
            histograms["queue"].observe(request.first_scheduled - request.arrival)
        counters.finished_requests += 1
        counters.finished_prompt_tokens += request.prompt_len
        counters.finished_generation_tokens += request.generated
        counters.finished_cached_tokens += request.hit_tokens
        counters.finished_offload_cached_tokens += request.offload_hit_tokens
        events.finished.append(request.id)
        return True

    # -- reporting -------------------------------------------------------------------------

    def _after_step(self, prefill_tokens: int, prefill_hits: int, finished: bool) -> None:
        if self.reporting.report_when_requests_finish:
            if finished:
                self.report = self._make_report(prefill_hit_ratio=0.0)
            return
        if prefill_tokens:
            total = prefill_tokens + prefill_hits
            self.report = self._make_report(prefill_hit_ratio=prefill_hits / total)
            return
        self._decode_steps_since_report += 1
        if self._decode_steps_since_report >= self.reporting.report_every_decode_steps:
            self.report = self._make_report(prefill_hit_ratio=0.0)

    def _make_report(self, prefill_hit_ratio: float) -> GaugeReport:
        elapsed = self.now - self._report_time
        report = GaugeReport(
            running=len(self.running),
            waiting=len(self.waiting),
            paused=sum(1 for request in self.waiting if request.first_scheduled is not None),
            used_blocks=self.pool.used,
            evictable_blocks=len(self.pool.evictable),
            free_blocks=self.pool.free,
            waiting_reason=self.waiting_reason,
            prefill_hit_ratio=prefill_hit_ratio,
            generation_throughput=self._tokens_since_report / elapsed if elapsed > 0 else 0.0,
            preemptions_since_last=self.counters.preemptions - self._preemptions_at_report,
        )
        self._decode_steps_since_report = 0
        self._tokens_since_report = 0
        self._preemptions_at_report = self.counters.preemptions
        self._report_time = self.now
        return report

    def snapshot(self) -> ModelSnapshot:
        return ModelSnapshot(
            config=self.config,
            started_at=self.started_at,
            now=self.now,
            report=self.report,
            counters=replace(self.counters),
            histograms={name: h.copy() for name, h in self.histograms.items()},
            offload_used_blocks=len(self.tier.blocks) if self.tier is not None else 0,
            offload_pinned_blocks=self.tier.pinned(self.now) if self.tier is not None else 0,
        )
