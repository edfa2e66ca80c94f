"""Subscribes to the targets' KV event streams (`kv_events:`) in the exporter's one event loop.

One ZMQ SUB socket per target and DP rank (zmq.asyncio: no thread per stream). Two tasks per stream:
the reader moves messages from the socket into a bounded queue (a full queue drops the message and
counts it, reason `overflow`) and the tracker decodes them and folds them into the pool's state.
Both hand the loop back after SLICE seconds of work, so a flooding engine loses its own messages
(counted), never delays the polls of /metrics or a scrape by more than a slice per turn of the loop.

Sequence numbers: a jump forward is a gap, asked back from the replay endpoint when there is one
(what does not come back is counted, reason `gap`); a step back is a publisher restart: the pool's
state is dropped, as the new process's blocks share nothing with the old one's.

A stream's pool is the DP rank its batches name (`[ts, events, dp_rank]`): an engine served by an API
server of its own (vLLM's external data parallelism) publishes rank 1 on an endpoint the configuration
may list first. Until a batch names one, and for engines that name none, it is the stream's place in
the target's endpoints; a batch naming another rank than that place is counted and logged once.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque

import zmq
import zmq.asyncio

from .. import contract, exposition
from ..blocks import Histogram, PoolState
from ..config import FleetIndexConfig, KVEventsConfig
from ..fleet import FleetIndex
from ..snapshot import Histogram as Buckets, RankValues
from ..tiers import Tiers
from ..sources.kvevents import END_SEQ, DecodeError, decode_payload, parse_seq

log = logging.getLogger(__name__)
# Seconds of work the reader and the tracker each do before the loop gets a turn. A count of messages
# bounds nothing: a batch of 64 stores and 64 removals takes 230 us to decode and fold, so a burst of
# 256 held the loop for 59 ms, and a poll, which needs a turn of the loop at each step, came 0.84 to
# 0.90 s apart at a 0.5 s interval while one stream flooded (tests/e2e/test_kvevents_stream.py). The
# reader moves a message in a few microseconds, so in equal slices it moves far more than the tracker
# handles: a stream faster than the tracker fills (and overflows) the exporter's queue, where it is
# counted, instead of backing up in libzmq's buffers as lag nobody sees.
SLICE = 0.005
QUEUE_MESSAGES = 10_000  # between the socket and the tracker, per stream
QUEUE_BYTES = 64 * 1024 * 1024
REPLAY_MAX = 10_000  # the engines' default replay buffer (buffer_steps): a longer gap is not asked for
REPLAY_TIMEOUT = 2.0  # seconds for a whole replay
RECEIVE_HWM = 10_000  # messages libzmq buffers for the reader
# The holder families' names after `adapter_`/`tenant_`, in the order of blocks.HolderCounts' counts.
HOLDER_FAMILIES = ("blocks_resident", "blocks_stored_total", "blocks_evicted_total", "capacity_miss_blocks_total")


class EventStream:
    """One engine's stream for one DP rank, and the pool state it drives."""

    def __init__(self, target, rank: int, endpoint: str, replay_endpoint: str | None, config: KVEventsConfig):
        self.target = target  # exporter Target: its labels, engine, model and polled capacity
        self.rank = rank  # configured: the endpoint's place in the target's `kv_events:` endpoints
        self.published_rank: int | None = None  # the rank the last batch that named one named
        self.rank_mismatches = 0
        self.endpoint, self.replay_endpoint, self.config = endpoint, replay_endpoint, config
        self.pool = PoolState()
        self.tiers = Tiers()  # the offload tiers the stream names beside the GPU pool
        self.messages = 0
        self.dropped = dict.fromkeys(contract.EVENT_DROP_REASONS, 0)
        self.ignored = dict.fromkeys(contract.EVENT_IGNORED_REASONS, 0)
        self.restarts = 0
        self.last_message: float | None = None
        self.last_seq: int | None = None
        self._queue: deque[list[bytes]] = deque()
        self._queued_bytes = 0
        self._overflow_unseen = 0  # overflowed messages the tracker has not yet met as a gap
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self._socket: zmq.asyncio.Socket | None = None
        self._context: zmq.asyncio.Context | None = None
        self._prefixes = exposition.Prefixes()
        self.fleet: FleetIndex | None = None  # the fleet index it feeds, when on (Subscribers sets it)

    @property
    def model(self) -> str | None:
        """The model its engine serves: as the page names it, else as configured."""
        return self.target.outcome.model or self.target.config.model

    @property
    def replica(self) -> tuple[str, int]:
        """Its pool's name in the fleet index."""
        return self.target.name, self.rank

    def start(self, context: zmq.asyncio.Context) -> None:
        self._context = context
        socket = self._socket = context.socket(zmq.SUB)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.RCVHWM, RECEIVE_HWM)
        # A frame above twice the limit is refused by libzmq, which then drops the connection for good (a
        # protocol error): _rejoin connects again and the lost sequence numbers show as a gap. Between the
        # limit and that, the message is refused here and counted as `decode`.
        socket.setsockopt(zmq.MAXMSGSIZE, 2 * self.config.max_message_bytes)
        socket.setsockopt(zmq.SUBSCRIBE, self.config.topic.encode())
        monitor = socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        socket.connect(self.endpoint)
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._read()), loop.create_task(self._track()),
                       loop.create_task(self._rejoin(monitor))]
        for task in self._tasks:
            task.add_done_callback(self._ended)

    def _ended(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("kv events of %s rank %d: %s stopped", self.target.name, self.rank, task.get_coro().__name__,
                      exc_info=task.exception())

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._socket is not None:
            self._socket.close(linger=0)

    async def _rejoin(self, monitor: zmq.asyncio.Socket) -> None:
        """Connect again after every disconnection: libzmq itself does after a network error, never after
        a protocol error (an oversized frame)."""
        try:
            while True:
                await monitor.recv_multipart()
                log.info("kv events of %s rank %d: disconnected from %s, connecting again", self.target.name,
                         self.rank, self.endpoint)
                try:
                    self._socket.disconnect(self.endpoint)
                except zmq.ZMQError:  # libzmq already let go of the endpoint
                    pass
                self._socket.connect(self.endpoint)
        finally:
            # The monitor stops before its reader goes: libzmq's I/O thread hands each event to the monitor's
            # PAIR socket with a blocking send, so a disconnection after this end closed (an engine stopping
            # with the exporter) blocked that thread for good, and with it disable_monitor, the context's
            # termination and so the exporter's exit.
            self._socket.disable_monitor()
            monitor.close(linger=0)

    async def _read(self) -> None:
        socket = self._socket
        while True:
            self._enqueue(await socket.recv_multipart())
            until = time.perf_counter() + SLICE
            while time.perf_counter() < until:
                try:  # what else is waiting, without a wait
                    frames = await socket.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                self._enqueue(frames)
            await asyncio.sleep(0)

    def _enqueue(self, frames: list[bytes]) -> None:
        size = sum(len(frame) for frame in frames)
        if len(self._queue) >= QUEUE_MESSAGES or self._queued_bytes + size > QUEUE_BYTES:
            self.dropped["overflow"] += 1
            self._overflow_unseen += 1
            return
        self._queue.append(frames)
        self._queued_bytes += size
        self._wake.set()

    async def _track(self) -> None:
        queue = self._queue
        while True:
            await self._wake.wait()
            self._wake.clear()
            until = time.perf_counter() + SLICE
            while queue:
                frames = queue.popleft()
                self._queued_bytes -= sum(len(frame) for frame in frames)
                try:
                    await self._handle(frames)
                except Exception:  # a tracker bug costs one message, never the stream
                    log.exception("kv events of %s rank %d: unexpected error", self.target.name, self.rank)
                    self.dropped["decode"] += 1
                if time.perf_counter() >= until:
                    await asyncio.sleep(0)
                    until = time.perf_counter() + SLICE

    async def _handle(self, frames: list[bytes]) -> None:
        if len(frames) != 3 or len(frames[1]) != 8:
            self.dropped["decode"] += 1
            return
        seq = parse_seq(frames[1])
        last = self.last_seq
        if last is not None:
            if seq <= last:
                log.info("kv events of %s rank %d: sequence went back (%d after %d), publisher restarted",
                         self.target.name, self.rank, seq, last)
                self.restarts += 1
                self.pool.reset()
                self.tiers.reset()
                if self.fleet is not None:
                    self.fleet.forget(self.replica)
            elif seq > last + 1:
                await self._fill_gap(last + 1, seq)
        self.last_seq = seq
        self._process(seq, frames[2])

    def _process(self, seq: int, payload: bytes) -> None:
        try:
            batch = decode_payload(seq, payload, self.config.max_message_bytes, token_ids=self.fleet is not None)
        except DecodeError as err:
            self.dropped["decode"] += 1
            log.debug("kv events of %s rank %d: message %d refused: %s", self.target.name, self.rank, seq, err)
            return
        self.messages += 1
        self.last_message = time.time()
        if batch.dp_rank is not None:
            if batch.dp_rank != self.rank:
                if not self.rank_mismatches:
                    log.warning("kv events of %s rank %d: %s publishes as DP rank %d; its series take that rank",
                                self.target.name, self.rank, self.endpoint, batch.dp_rank)
                self.rank_mismatches += 1
            self.published_rank = batch.dp_rank
        self.ignored["unknown_type"] += batch.unknown_types
        self.ignored["unknown_field"] += batch.unknown_fields
        # The pool's size as the target's last poll saw it, taken here where the pool changes (a scrape only reads).
        self.pool.set_capacity(self._capacity())
        for tier in self.tiers.pools:
            self.tiers.set_capacity(tier, self._tier_capacity(tier))
        self.tiers.apply(self.pool, batch.ts, batch.events)
        model = self.model
        if self.fleet is not None and model:  # a replica of no known model yet joins once its page names one
            self.fleet.apply(self.replica, model, batch.events)

    async def _fill_gap(self, first: int, stop: int) -> None:
        """Messages first..stop-1 never arrived: ask the replay endpoint for them, count the rest."""
        missing = stop - first
        overflowed = min(missing, self._overflow_unseen)
        self._overflow_unseen -= overflowed
        recovered = 0
        # Messages our own queue dropped are not asked back: the stream is flooding already.
        if self.replay_endpoint and overflowed < missing <= REPLAY_MAX:
            recovered = await self._replay(first, stop)
        self.dropped["gap"] += max(0, missing - overflowed - recovered)

    async def _replay(self, first: int, stop: int) -> int:
        """Replay first..stop-1 (vLLM's and SGLang's ROUTER protocol); the number handled."""
        socket = self._context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.MAXMSGSIZE, 2 * self.config.max_message_bytes)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + REPLAY_TIMEOUT
        handled, expected = 0, first
        until = time.perf_counter() + SLICE
        try:
            socket.connect(self.replay_endpoint)
            await socket.send_multipart([b"", first.to_bytes(8, "big")])
            while (remaining := deadline - loop.time()) > 0:
                if not await socket.poll(remaining * 1000):
                    break
                frames = await socket.recv_multipart()
                if frames and frames[0] == b"":
                    frames = frames[1:]
                # [seq, payload] (SGLang, vLLM before 0.26) or [topic, seq, payload]
                if len(frames) not in (2, 3) or len(frames[-2]) != 8:
                    break
                seq = parse_seq(frames[-2])
                if seq == END_SEQ or seq >= stop:
                    break
                if seq == expected:
                    self._process(seq, frames[-1])
                    handled += 1
                    expected += 1
                if time.perf_counter() >= until:
                    await asyncio.sleep(0)
                    until = time.perf_counter() + SLICE
        except zmq.ZMQError as err:
            log.warning("kv events of %s rank %d: replay from %s failed: %s", self.target.name, self.rank,
                        self.replay_endpoint, err)
        finally:
            socket.close(linger=0)
        if handled < stop - first:
            log.info("kv events of %s rank %d: replay returned %d of %d missing batches", self.target.name,
                     self.rank, handled, stop - first)
        return handled

    @property
    def pool_rank(self) -> int:
        """The DP rank of the pool this stream describes: the one its batches name, else the configured one."""
        return self.rank if self.published_rank is None else self.published_rank

    def _capacity(self) -> float | None:
        rank = self.target.outcome.ranks.get(str(self.pool_rank))
        return rank.gauges.get("capacity_blocks") if rank is not None else None

    def _tier_capacity(self, tier: str) -> float | None:
        """An offload tier's capacity in blocks: its polled tokens over the pool's block size (vLLM offloads one
        block per chunk by default, and its self-describing events name every block of a chunk)."""
        rank = self.target.outcome.ranks.get(str(self.pool_rank))
        if rank is None:
            return None
        tokens = rank.labelled.get("tier_capacity_tokens", {}).get((tier,))
        block = rank.gauges.get("block_size_tokens") or self.tiers.block_size
        return tokens // block if tokens and block else None

    def render(self, rank: int) -> exposition.TargetText:
        """The stream's series, labelled as the pool of DP rank `rank`."""
        target, outcome, pool = self.target, self.target.outcome, self.pool
        labels = {"target": target.name, "engine": outcome.engine, "model": outcome.model, "dp_rank": str(rank),
                  "role": outcome.role, **target.labels}
        counters = {"events_blocks_stored_total": pool.stored, "events_blocks_evicted_total": pool.evicted,
                    "capacity_miss_blocks_total": pool.capacity_misses, "recomputed_blocks_total": pool.recomputed,
                    "events_messages_total": self.messages,
                    "events_publisher_restarts_total": self.restarts,
                    "events_rank_mismatches_total": self.rank_mismatches}
        gauges = {} if self.last_message is None else {"events_last_message_timestamp_seconds": self.last_message}
        if self.tiers.block_size:
            gauges["events_block_size_tokens"] = self.tiers.block_size
        labelled = {"events_dropped_total": self.dropped, "events_ignored_total": {**self.ignored, **pool.ignored}}
        histograms = {"capacity_miss_distance_ratio": _buckets(pool.distance),
                      "block_residency_seconds": _buckets(pool.residency)}
        labelled_values = {name: {(reason,): float(count) for reason, count in counts.items()}
                           for name, counts in labelled.items()}
        labelled_values.update(_holder_series(pool, self.config.top_holders))
        values = RankValues(gauges, {name: float(count) for name, count in counters.items()}, histograms,
                            labelled_values)
        text = exposition.render_pool(labels, values, self._prefixes)
        for tier, state in self.tiers.pools.items():
            tier_values = RankValues(
                {"tier_blocks_resident": float(len(state.resident))},
                {"tier_events_blocks_stored_total": float(state.stored),
                 "tier_events_blocks_evicted_total": float(state.evicted),
                 "tier_capacity_miss_blocks_total": float(state.capacity_misses),
                 "tier_served_blocks_total": float(self.tiers.served[tier])},
                {"tier_capacity_miss_distance_ratio": _buckets(state.distance),
                 "tier_block_residency_seconds": _buckets(state.residency)})
            tiered = exposition.render_pool({**labels, "tier": tier}, tier_values, self._prefixes)
            for family, lines in tiered.status.items():
                text.status[family] = text.status.get(family, b"") + lines
        return text


def _holder_series(pool: PoolState, top_holders: int) -> dict[str, dict[tuple[str, ...], float]]:
    """The per-adapter and per-tenant families of a pool: its top holders by resident blocks and `other`."""
    series: dict[str, dict[tuple[str, ...], float]] = {"events_holders_folded": {}}
    for holder, counts in (("adapter", pool.adapters), ("tenant", pool.tenants)):
        shown, folded = counts.top(top_holders)
        series["events_holders_folded"][(holder,)] = float(folded)
        for position, name in enumerate(HOLDER_FAMILIES):
            series[f"{holder}_{name}"] = {(label,): float(values[position]) for label, values in shown.items()}
    return series


def _buckets(histogram: Histogram) -> Buckets:
    return Buckets([(bound, float(count)) for bound, count in histogram.cumulative()], float(histogram.sum),
                   float(histogram.count))


class Subscribers:
    """Every configured target's streams; lives in the poll loop (all methods run there)."""

    def __init__(self) -> None:
        self.streams: dict[tuple, EventStream] = {}
        self.fleet: FleetIndex | None = None
        self._fleet_config: FleetIndexConfig | None = None
        self._fleet_prefixes = exposition.Prefixes()
        self._labels: dict[str, str] = {}
        self._context: zmq.asyncio.Context | None = None
        # The streams' text, rendered at most once a poll interval (as a target's is after each poll): ranking
        # thousands of tenants per scrape would cost every client of /metrics, and a scrape only joins text.
        self._texts: list[exposition.TargetText] = []
        self._rendered_at = -math.inf

    async def replace(self, targets, fleet_index: FleetIndexConfig = FleetIndexConfig(),
                      labels: dict[str, str] | None = None) -> None:
        """Subscribe to these targets' streams; a stream whose target and settings stay keeps its state (and the
        fleet index, with its settings unchanged). `labels`: the configuration's static labels, the fleet's."""
        self._labels = labels or {}
        if self._context is None:
            self._context = zmq.asyncio.Context()
        wanted = {}
        for target in targets:
            events = target.config.kv_events
            for rank, endpoint, replay in (events.endpoints() if events else ()):
                wanted[(target.name, rank, endpoint, replay, events)] = (target, rank, endpoint, replay, events)
        for key in [key for key in self.streams if key not in wanted]:
            stream = self.streams.pop(key)
            await stream.close()
            if self.fleet is not None:
                self.fleet.forget(stream.replica, drop=True)
        if fleet_index != self._fleet_config:
            self._fleet_config = fleet_index
            self.fleet = FleetIndex(fleet_index.max_blocks) if fleet_index.enabled else None
        for key, (target, rank, endpoint, replay, events) in wanted.items():
            stream = self.streams.get(key)
            if stream is None:
                stream = self.streams[key] = EventStream(target, rank, endpoint, replay, events)
                stream.start(self._context)
            stream.target = target
            stream.fleet = self.fleet
        self._rendered_at = -math.inf

    async def close(self) -> None:
        for stream in self.streams.values():
            await stream.close()
        self.streams = {}
        if self._context is not None:
            self._context.destroy(linger=0)
            self._context = None

    def render(self, now: float, max_age: float) -> list[exposition.TargetText]:
        """Every stream's series, as rendered within `max_age` seconds before `now` (monotonic)."""
        if now - self._rendered_at >= max_age:
            self._texts, self._rendered_at = self._render_all(), now
        return self._texts

    def _render_all(self) -> list[exposition.TargetText]:
        """Where two streams of a target name the same DP rank, the target's streams keep their configured
        ranks: one pool's series twice would make the scrape fail."""
        by_target: dict[str, list[EventStream]] = {}
        for stream in self.streams.values():
            by_target.setdefault(stream.target.name, []).append(stream)
        texts = []
        for streams in by_target.values():
            ranks = [stream.pool_rank for stream in streams]
            if len(set(ranks)) < len(ranks):
                ranks = [stream.rank for stream in streams]
            texts.extend(stream.render(rank) for stream, rank in zip(streams, ranks))
        if self.fleet is not None:
            for stream in self.streams.values():
                if stream.model:
                    self.fleet.join(stream.replica, stream.model)
            texts.extend(fleet_texts(self.fleet, self._fleet_prefixes, self._labels))
        return texts


def fleet_texts(fleet: FleetIndex, prefixes: exposition.Prefixes, labels: dict[str, str]) -> list[exposition.TargetText]:
    """Each model's fleet series (exporter.fleet), with the configuration's static `labels`."""
    texts = []
    for model, replicas in fleet.models.items():
        gauges = {"fleet_replicas": len(replicas.replicas), "fleet_isolated_replicas": replicas.isolated(),
                  "fleet_index_blocks": sum(len(r.keys) for r in replicas.replicas.values()),
                  "fleet_index_sampling_ratio": fleet.rate}
        counters = {"routing_recomputed_tokens_total": replicas.recomputed_tokens,
                    "fleet_stored_tokens_total": replicas.stored_tokens,
                    "fleet_hash_only_blocks_total": replicas.hash_only_blocks,
                    "fleet_hash_mismatch_blocks_total": replicas.hash_mismatch_blocks}
        values = RankValues({name: float(value) for name, value in gauges.items()}, counters)
        texts.append(exposition.render_pool({"model": model, **labels}, values, prefixes))
    return texts
