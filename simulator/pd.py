"""A disaggregated prefill/decode pair of one model: a prefill engine, a decode engine and the KV transfer
between them, each engine serving its /metrics as vLLM (NIXL connector) or SGLang (--disaggregation-mode)
does.

The model (`PDModel`) is pure and deterministic, advanced in fixed ticks of simulated time:

- Prefill: requests queue for the prefill pool (`prefill.num_blocks` blocks; `max_num_seqs` computing at
  once), are computed at the pool's token rate (`max_num_batched_tokens` per step of `step_base_s +
  step_per_token_s` x tokens) and keep their prompt's blocks until the decode side has the KV.
- Decode: each request needs blocks for its prompt and output at once; it runs one token per step
  (`step_base_s + step_per_token_s` x running requests), at most `max_num_seqs` received or running.
- The link (`LinkConfig`): one transfer after another, `latency_s` + bytes / `bytes_per_s` each (bytes =
  prompt tokens x the decode engine's `kv_bytes_per_token`); `failure_ratio` of them fail (seeded), the request
  is dropped and both sides free its blocks (vLLM's kv_load_failure_policy=fail).
- vLLM (`pull`): the prefill side computes first and holds the KV until the decode side pulls it; a request
  waits to start while the decode pool cannot allocate its blocks or its running cap binds; the prefill side
  frees held KV whose lease (`lease_s`, vLLM's kv_lease_duration) ran out before the pull started and counts an
  expiry; a transfer of such a request still completes (the decode side does not know) and the prefill side
  counts a notification after expiry. The decode side times each transfer (NIXL's histograms).
- SGLang (push): the decode side pre-allocates first (its pre-allocation queue; the prefill side's bootstrap
  queue holds the same requests), then the prefill side computes and sends (its inflight queue), timing the
  transfer itself. No lease.

The first token comes out on the decode side; vLLM's prefill side also reports its one generated token (the
proxy sends it max_tokens=1) and finishes the request then, SGLang's prefill side no TTFT and finishes the request
(its prompt tokens, its latency) once the transfer is done. KV the prefill side holds for export is in its used
blocks and in neither its running nor its waiting count, as on both engines: `held_blocks()`. Several decode
replicas may sit behind the one prefill engine (`decode_replicas`, `PDPair.add_decode`): the router sends each
request to them in turn, as it arrives.
"""

from __future__ import annotations

import random
import threading
import time
from collections import deque
from dataclasses import dataclass, field, replace
from http.server import ThreadingHTTPServer
from typing import Any, Callable, Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from .exposition import (FLAVORS, MP, VLLM_V1, EngineState, SglangCollector, VllmCollector, counter, gauge,
                         histogram)
from .model import Counters, EngineConfig, GaugeReport, Histogram, ModelSnapshot, Request
from .scenarios import (Phase, Scenario, ScenarioError, _Fields, _parse_engine, _segments, parse_scenario,
                        scenario_data)
from .server import TICK_S, _handler_for
from .workload import ArrivalProcess

TICK = 0.01  # simulated seconds per model tick
# vLLM NIXL's buckets (nixl/stats.py); SGLang's transfer histograms in ms and MiB (metrics_collector.py).
NIXL_SECONDS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 5.0)
NIXL_BYTES = tuple(float(2 ** (10 + i)) for i in range(1, 25, 2))
SGLANG_MS = (1.0, 2.0, 5.0, 10.0, 25.0, 50.0, 100.0, 250.0, 500.0, 1000.0, 2500.0, 5000.0)
SGLANG_MB = (1.0, 5.0, 10.0, 50.0, 100.0, 500.0, 1000.0, 5000.0, 10000.0)
SGLANG_GB_S = (0.1, 0.5, 1.0, 5.0, 10.0, 25.0, 50.0, 100.0, 200.0, 400.0)  # its speed: MiB / 1024 over seconds
MIB = 2 ** 20
FLAVOR_OF = {"vllm": "vllm-v1", "sglang": "sglang"}


@dataclass(frozen=True)
class LinkConfig:
    latency_s: float = 0.002
    bytes_per_s: float = 25e9
    lease_s: float = 30.0  # vLLM's kv_lease_duration
    failure_ratio: float = 0.0  # of the transfers, at random (seeded)


@dataclass(frozen=True)
class PDScenario:
    name: str
    phases: tuple[Phase, ...]
    prefill: EngineConfig
    decode: EngineConfig
    link: LinkConfig
    then: str = "repeat"


_WORKLOAD = {"prompt_len": {"dist": "lognormal", "median": 1000, "sigma": 0.4, "min": 64, "max": 4000},
             "output_len": {"dist": "lognormal", "median": 150, "sigma": 0.4, "min": 16, "max": 1000},
             "prefix_share": 0.0}
_PREFILL = {"num_blocks": 32768, "max_num_seqs": 64, "max_num_batched_tokens": 8192}
BUILTIN_PD_SCENARIOS: dict[str, dict[str, Any]] = {
    # 3 req/s with room on both sides: transfers of ~130 MB in ~7 ms, no queue, no expiry.
    "pd-steady": {
        "prefill": _PREFILL, "decode": {"num_blocks": 8192, "max_num_seqs": 64},
        "phases": [{"name": "steady", "duration_s": 600, "arrival_rate": 3, **_WORKLOAD}],
    },
    # The decode pool (768 blocks, ~12k tokens) cannot hold the requests the prefill side produces from ~60 s:
    # transfers wait for decode KV while the prefill side holds theirs (lease long enough not to expire).
    "pd-decode-short": {
        "prefill": _PREFILL, "decode": {"num_blocks": 1536, "max_num_seqs": 64}, "link": {"lease_s": 600},
        "phases": [{"name": "warm-up", "duration_s": 60, "arrival_rate": 0.5, **_WORKLOAD},
                   {"name": "decode-short", "duration_s": 540, "arrival_rate": 2.6,
                    "output_len": {"dist": "lognormal", "median": 400, "sigma": 0.3, "min": 16, "max": 1000}}],
    },
    # The decode side runs 2 requests at a time (KV to spare): requests wait longer than the 10 s lease, their
    # prefill KV expires, and their transfers complete after it.
    "pd-lease-expiry": {
        "prefill": _PREFILL, "decode": {"num_blocks": 8192, "max_num_seqs": 2}, "link": {"lease_s": 10},
        "phases": [{"name": "slow-decode", "duration_s": 600, "arrival_rate": 1, **_WORKLOAD}],
    },
    # pd-steady with one transfer in five failing.
    "pd-transfer-failures": {
        "prefill": _PREFILL, "decode": {"num_blocks": 8192, "max_num_seqs": 64}, "link": {"failure_ratio": 0.2},
        "phases": [{"name": "failing", "duration_s": 600, "arrival_rate": 3, **_WORKLOAD}],
    },
}


def load_pd_scenario(name_or_path: str) -> PDScenario:
    """A built-in P/D scenario by name, or a YAML P/D scenario file by path."""
    data, source, name = scenario_data(name_or_path, BUILTIN_PD_SCENARIOS, "not a P/D scenario")
    return parse_pd_scenario(data, source=source, name=name)


def parse_pd_scenario(data: Any, source: str, name: str) -> PDScenario:
    top = _Fields(source, "", data, {"name", "then", "prefill", "decode", "link", "phases"})
    phases = parse_scenario({"phases": data.get("phases"), "then": data.get("then", "repeat")}, source, name)
    link = _Fields(source, "link", data.get("link", {}), {"latency_s", "bytes_per_s", "lease_s", "failure_ratio"})
    defaults = LinkConfig()
    return PDScenario(
        name=top.text("name", name), phases=phases.phases, then=phases.then,
        prefill=_parse_engine(source, data.get("prefill", {}), "prefill"),
        decode=_parse_engine(source, data.get("decode", {}), "decode"),
        link=LinkConfig(latency_s=link.number("latency_s", defaults.latency_s),
                        bytes_per_s=link.number("bytes_per_s", defaults.bytes_per_s, above_minimum=True),
                        lease_s=link.number("lease_s", defaults.lease_s, above_minimum=True),
                        failure_ratio=link.number("failure_ratio", defaults.failure_ratio, maximum=1.0)))


@dataclass(eq=False)
class Transfer:
    """One request on its way through the pair."""

    request: Request
    prefill_blocks: int
    decode_blocks: int
    prefill_left: int
    decode_arrival: float = 0.0  # when it reached the decode side's queue
    prefill_done: float | None = None
    start: float | None = None
    end: float | None = None
    failed: bool = False
    expired: bool = False  # the prefill side freed its KV at lease expiry
    tokens: float = 0.0  # decode progress, in tokens (fractional between steps)
    to: DecodeReplica | None = None  # the decode replica the router sent it to


@dataclass(frozen=True)
class TransferUnits:
    """How an engine's transfer histograms count: bucket bounds, and the factor from seconds and bytes."""

    seconds: tuple[float, ...]
    per_second: float
    size: tuple[float, ...]
    per_byte: float
    speed: tuple[float, ...] = ()  # a per-transfer speed histogram's bounds (SGLang's), none for vLLM
    per_byte_per_second: float = 1.0


VLLM_UNITS = TransferUnits(NIXL_SECONDS, 1.0, NIXL_BYTES, 1.0)
SGLANG_UNITS = TransferUnits(SGLANG_MS, 1000.0, SGLANG_MB, 1 / MIB, SGLANG_GB_S, 1 / 2**30)


@dataclass
class Side:
    """One engine of the pair: its pool, its series and its transfer series."""

    config: EngineConfig
    buckets: Any
    units: TransferUnits
    used: int = 0
    counters: Counters = field(default_factory=Counters)
    histograms: dict[str, Histogram] = field(default_factory=dict)
    failed_transfers: int = 0
    lease_expiries: int = 0
    notifications_after_expiry: int = 0
    # vLLM's decode side: prompt tokens of the loads planned (its `p2p` hits, counted when the blocks are allocated,
    # failed and unfinished loads included), and of those received and run (`external_kv_transfer`, counted at
    # the request's first token).
    peer_tokens_planned: int = 0
    peer_tokens: int = 0

    def __post_init__(self) -> None:
        b = self.buckets
        self.histograms = {"ttft": Histogram(b.ttft), "itl": Histogram(b.itl), "e2e": Histogram(b.e2e),
                           "queue": Histogram(b.queue), "iteration_tokens": Histogram(b.iteration_tokens),
                           "offload_load": Histogram(()), "offload_store": Histogram(())}
        self.transfer_seconds = Histogram(self.units.seconds)
        self.transfer_bytes = Histogram(self.units.size)
        self.transfer_speed = Histogram(self.units.speed)

    def timed(self, seconds: float, nbytes: float) -> None:
        self.transfer_seconds.observe(seconds * self.units.per_second)
        self.transfer_bytes.observe(nbytes * self.units.per_byte)
        if self.units.speed and seconds > 0:
            self.transfer_speed.observe(nbytes / seconds * self.units.per_byte_per_second)

    @property
    def free(self) -> int:
        return self.config.num_blocks - self.used

    def finish(self, transfer: Transfer, now: float, prompt: int, generated: int) -> None:
        counters = self.counters
        counters.finished_requests += 1
        counters.finished_prompt_tokens += prompt
        counters.finished_generation_tokens += generated
        self.histograms["e2e"].observe(now - transfer.request.arrival)


@dataclass
class DecodeReplica:
    """One decode engine behind the prefill engine: its side and its queues."""

    side: Side
    # vLLM: no decode blocks yet; SGLang: pre-allocation.
    waiting_to_start: deque[Transfer] = field(default_factory=deque)
    receiving: list[Transfer] = field(default_factory=list)  # decode blocks allocated, KV not there yet
    received: deque[Transfer] = field(default_factory=deque)  # KV there, not running yet
    running: list[Transfer] = field(default_factory=list)


class PDModel:
    """One prefill engine and `decode_replicas` decode engines (a pair: one); the router sends each request to the
    decode replicas in turn (`add_decode` adds one)."""

    def __init__(self, scenario: PDScenario, pull: bool, buckets: Any, seed: int = 0, decode_replicas: int = 1):
        self.scenario, self.pull = scenario, pull
        self.buckets, self.units = buckets, VLLM_UNITS if pull else SGLANG_UNITS
        self.prefill = Side(scenario.prefill, buckets, self.units)
        self.decodes: list[DecodeReplica] = []
        for _ in range(decode_replicas):
            self.add_decode()
        self._routed = 0
        self.rng = random.Random(seed)
        self.now = 0.0
        # The phases drive arrivals only: the engine of a plain Scenario is unused here.
        self._segments = _segments(Scenario(scenario.name, scenario.phases, scenario.decode, scenario.then))
        self.segment = next(self._segments)
        self.arrivals = ArrivalProcess(self.segment.workload, random.Random(seed + 1),
                                       min(scenario.prefill.effective_max_model_len,
                                           scenario.decode.effective_max_model_len))
        self.prefill_waiting: deque[Transfer] = deque()  # to be computed
        self.computing: list[Transfer] = []
        # Prefill KV kept for the decode side (vLLM) / being sent (SGLang), by request id; vLLM's in the order
        # their leases run out.
        self.held: dict[int, Transfer] = {}
        self._leases: deque[Transfer] = deque()
        self.link_free_at = 0.0

    def add_decode(self) -> DecodeReplica:
        """A decode replica more; the router sends it its share of the requests that arrive from now on."""
        replica = DecodeReplica(Side(self.scenario.decode, self.buckets, self.units))
        self.decodes.append(replica)
        return replica

    @property
    def decode(self) -> Side:
        """A pair's one decode engine (the first of a fleet's)."""
        return self.decodes[0].side

    def _blocks(self, tokens: int, config: EngineConfig) -> int:
        return -(-tokens // config.block_size)

    def advance_to(self, t: float) -> None:
        while self.now + TICK <= t:
            self.now += TICK
            if self.now >= self.segment.end:
                self.segment = next(self._segments)
                self.arrivals.set_workload(self.segment.workload, self.segment.start)
            self._tick()

    def _tick(self) -> None:
        for request in self.arrivals.until(self.now):
            self._arrive(request)
        self._expire_leases()
        for replica in self.decodes:
            self._admit_decode(replica)
        self._admit_prefill()
        self._compute_prefill()
        for replica in self.decodes:
            self._complete_transfers(replica)
            self._decode(replica)

    def _arrive(self, request: Request) -> None:
        transfer = Transfer(request, self._blocks(request.prompt_len, self.prefill.config),
                            self._blocks(request.prompt_len + request.output_len, self.scenario.decode),
                            request.prompt_len, decode_arrival=request.arrival,
                            to=self.decodes[self._routed % len(self.decodes)])
        self._routed += 1
        (self.prefill_waiting if self.pull else transfer.to.waiting_to_start).append(transfer)

    def _expire_leases(self) -> None:
        lease = self.scenario.link.lease_s
        while self._leases and self.now - self._leases[0].prefill_done >= lease:
            transfer = self._leases.popleft()
            if transfer.start is None:  # not pulled in time
                del self.held[transfer.request.id]
                transfer.expired = True
                self.prefill.used -= transfer.prefill_blocks
                self.prefill.lease_expiries += 1

    def _admit_decode(self, replica: DecodeReplica) -> None:
        """FCFS into a decode pool: all of a request's blocks, within the cap on received and running ones."""
        decode = replica.side
        while replica.waiting_to_start:
            transfer = replica.waiting_to_start[0]
            busy = len(replica.receiving) + len(replica.received) + len(replica.running)
            if busy >= decode.config.max_num_seqs or transfer.decode_blocks > decode.free:
                return
            replica.waiting_to_start.popleft()
            decode.used += transfer.decode_blocks
            decode.histograms["queue"].observe(self.now - transfer.decode_arrival)
            replica.receiving.append(transfer)
            if self.pull:
                decode.peer_tokens_planned += transfer.request.prompt_len
                self._start_transfer(transfer)
            else:
                self.prefill_waiting.append(transfer)  # the handshake is done: the prefill side may compute

    def _admit_prefill(self) -> None:
        config, prefill = self.prefill.config, self.prefill
        while self.prefill_waiting and len(self.computing) < config.max_num_seqs:
            transfer = self.prefill_waiting[0]
            if transfer.prefill_blocks > prefill.free:
                return
            self.prefill_waiting.popleft()
            prefill.used += transfer.prefill_blocks
            self.computing.append(transfer)

    def _compute_prefill(self) -> None:
        config = self.prefill.config
        step = config.step_base_s + config.step_per_token_s * config.max_num_batched_tokens
        budget = config.max_num_batched_tokens * TICK / step
        for transfer in list(self.computing):
            if budget <= 0:
                break
            done = min(transfer.prefill_left, budget)
            transfer.prefill_left -= done
            budget -= done
            if transfer.prefill_left <= 0:
                self._prefilled(transfer)

    def _prefilled(self, transfer: Transfer) -> None:
        request, prefill = transfer.request, self.prefill
        self.computing.remove(transfer)
        transfer.prefill_done = self.now
        self.held[request.id] = transfer
        prefill.counters.prompt_tokens += request.prompt_len
        if self.pull:  # vLLM's prefill side generates the one token it was asked for
            prefill.counters.generation_tokens += 1
            prefill.histograms["ttft"].observe(self.now - request.arrival)
            prefill.finish(transfer, self.now, request.prompt_len, 1)
            transfer.decode_arrival = self.now
            transfer.to.waiting_to_start.append(transfer)
            self._leases.append(transfer)
        else:
            self._start_transfer(transfer)

    def _start_transfer(self, transfer: Transfer) -> None:
        link = self.scenario.link
        nbytes = transfer.request.prompt_len * self.scenario.decode.kv_bytes_per_token
        transfer.start = max(self.now, self.link_free_at)
        transfer.end = self.link_free_at = transfer.start + link.latency_s + nbytes / link.bytes_per_s
        transfer.failed = self.rng.random() < link.failure_ratio

    def _complete_transfers(self, replica: DecodeReplica) -> None:
        decode = replica.side
        for transfer in [t for t in replica.receiving if t.end is not None and t.end <= self.now]:
            replica.receiving.remove(transfer)
            timer = decode if self.pull else self.prefill  # the side that times transfers
            if transfer.expired:
                self.prefill.notifications_after_expiry += 1
            elif self.held.pop(transfer.request.id, None) is not None:
                self.prefill.used -= transfer.prefill_blocks
            if transfer.failed:
                timer.failed_transfers += 1
                decode.used -= transfer.decode_blocks
                continue
            timer.timed(transfer.end - transfer.start, transfer.request.prompt_len * decode.config.kv_bytes_per_token)
            if not self.pull:  # SGLang's prefill side streams the request out once its inflight queue polls it sent
                self.prefill.finish(transfer, self.now, transfer.request.prompt_len, 1)
            decode.counters.prompt_tokens += transfer.request.prompt_len
            replica.received.append(transfer)

    def _decode(self, replica: DecodeReplica) -> None:
        decode, config = replica.side, replica.side.config
        while replica.received:
            replica.running.append(replica.received.popleft())
        if not replica.running:
            return
        itl = config.step_base_s + config.step_per_token_s * len(replica.running)
        for transfer in list(replica.running):
            request = transfer.request
            transfer.tokens += TICK / itl
            while request.generated < min(int(transfer.tokens), request.output_len):
                request.generated += 1
                decode.counters.generation_tokens += 1
                if request.generated == 1:
                    decode.histograms["ttft"].observe(self.now - request.arrival)
                    decode.peer_tokens += request.prompt_len
                else:
                    decode.histograms["itl"].observe(itl)
            if request.generated >= request.output_len:
                replica.running.remove(transfer)
                decode.used -= transfer.decode_blocks
                decode.finish(transfer, self.now, request.prompt_len, request.generated)

    # -- what the pages show ---------------------------------------------------------------------

    def held_blocks(self) -> int:
        """Prefill blocks held for export: prompts computed whose KV the decode side has not pulled (vLLM) or
        received (SGLang) yet."""
        return sum(transfer.prefill_blocks for transfer in self.held.values())

    def stages(self, replica: int = 0) -> dict[str, dict[str, int]]:
        """Requests by transfer stage, per side (the decode side: replica `replica`), as the engine counts them."""
        decode = self.decodes[replica]
        stages = {"decode": {"waiting_to_start": len(decode.waiting_to_start), "in_progress": len(decode.receiving),
                             "completed_waiting": len(decode.received)}, "prefill": {}}
        if not self.pull:  # SGLang's bootstrap queue holds what every decode replica has not pre-allocated yet
            stages["prefill"] = {"waiting_to_start": sum(len(d.waiting_to_start) for d in self.decodes),
                                 "in_progress": len(self.held)}
        return stages

    def snapshot(self, role: str, replica: int = 0) -> ModelSnapshot:
        decode = self.decodes[replica]
        side = self.prefill if role == "prefill" else decode.side
        if role == "prefill":
            running, waiting, deferred = len(self.computing), len(self.prefill_waiting), 0
        elif self.pull:  # vLLM: a request waits for capacity until its blocks are allocated, then is deferred
            deferred = len(decode.receiving) + len(decode.received)
            running, waiting = len(decode.running), len(decode.waiting_to_start) + deferred
        else:  # SGLang: the waiting queue holds the requests whose KV arrived (num_queue_reqs)
            running, waiting, deferred = len(decode.running), len(decode.received), 0
        report = GaugeReport(running=running, waiting=waiting, paused=0, used_blocks=side.used, evictable_blocks=0,
                             free_blocks=side.free, waiting_reason=None, prefill_hit_ratio=0.0,
                             generation_throughput=0.0, preemptions_since_last=0)
        return ModelSnapshot(side.config, 0.0, self.now, report, replace(side.counters),
                             {name: h.copy() for name, h in side.histograms.items()}, deferred=deferred)


@dataclass(frozen=True)
class PDSideState:
    """One side's transfer series, as of a tick."""

    role: str
    stages: dict[str, int]
    transfer_seconds: Histogram  # in the engine's unit (SGLang: ms)
    transfer_bytes: Histogram  # in the engine's unit (SGLang: MiB)
    transfer_speed: Histogram  # SGLang's, GiB/s; empty for vLLM
    failed_transfers: int
    lease_expiries: int
    notifications_after_expiry: int
    peer_tokens_planned: int
    peer_tokens: int


def _side_state(model: PDModel, role: str, replica: int = 0) -> PDSideState:
    side = model.prefill if role == "prefill" else model.decodes[replica].side
    return PDSideState(role, model.stages(replica)[role], side.transfer_seconds.copy(), side.transfer_bytes.copy(),
                       side.transfer_speed.copy(), side.failed_transfers, side.lease_expiries, side.notifications_after_expiry, side.peer_tokens_planned,
                       side.peer_tokens)


class VllmConnectorCollector(Collector):
    """The NIXL connector's families (registered on both sides) and, on the decode side (a KV consumer), the
    fetch stages, the prompt tokens it received and those it planned to load."""

    def __init__(self, source: Callable[[], tuple[EngineState, PDSideState]]):
        self.source = source

    def collect(self) -> Iterator[Metric]:
        state, pd = self.source()
        labels = {"model_name": state.model_name, "engine": "0"}
        created = state.created_unix
        yield histogram("vllm:nixl_xfer_time_seconds", "Histogram of transfer duration for NIXL KV Cache transfers.",
                        [(labels, pd.transfer_seconds)], created)
        yield histogram("vllm:nixl_bytes_transferred", "Histogram of bytes transferred per NIXL KV Cache transfers.",
                        [(labels, pd.transfer_bytes)], created)
        for name, doc, value in (
            ("vllm:nixl_num_failed_transfers_total", "Number of failed NIXL KV Cache transfers.", pd.failed_transfers),
            ("vllm:nixl_num_failed_notifications_total", "Number of failed NIXL KV Cache notifications.", 0),
            ("vllm:nixl_num_kv_expired_reqs_total", "Number of requests that had their KV expire. NOTE: This metric "
             "is tracked on the P instance.", pd.lease_expiries),
            ("vllm:nixl_num_notifications_after_expiry_total", "Number of transfer completion notifications for "
             "requests whose KV had expired.", pd.notifications_after_expiry),
        ):
            yield counter(name, doc, [(labels, float(value))], created)
        if pd.role != "decode":
            return
        yield gauge("vllm:num_requests_kv_fetch_by_stage", "Number of requests fetching KV from a remote instance, "
                    "by stage.", [({**labels, "stage": stage}, float(n)) for stage, n in pd.stages.items()])
        yield counter("vllm:prompt_tokens_by_source_total", "Number of prompt tokens by source.",
                      [({**labels, "source": "external_kv_transfer"}, float(pd.peer_tokens))], created)
        if pd.peer_tokens_planned:  # a source's child appears at its first increment
            yield counter("vllm:prompt_tokens_cached_by_source_total", "Cached prompt tokens by where the KV came "
                          "from.", [({**labels, "source": "p2p"}, float(pd.peer_tokens_planned))], created)


class SglangDisaggregationCollector(Collector):
    """SGLang's P/D queue gauges (every role exports all four) and, on the prefill side, the transfer
    histograms (ms, MiB, GiB/s) and the failure counter created at the first failure."""

    def __init__(self, source: Callable[[], tuple[EngineState, PDSideState]]):
        self.source = source

    def collect(self) -> Iterator[Metric]:
        state, pd = self.source()
        labels = {"engine_type": pd.role, "model_name": state.model_name, "moe_ep_rank": "0", "pp_rank": "0",
                  "tp_rank": "0"}
        stages = pd.stages
        for name, role, stage in (("sglang:num_prefill_bootstrap_queue_reqs", "prefill", "waiting_to_start"),
                                  ("sglang:num_prefill_inflight_queue_reqs", "prefill", "in_progress"),
                                  ("sglang:num_decode_prealloc_queue_reqs", "decode", "waiting_to_start"),
                                  ("sglang:num_decode_transfer_queue_reqs", "decode", "in_progress")):
            yield gauge(name, MP, [(labels, float(stages.get(stage, 0) if role == pd.role else 0))])
        if pd.transfer_seconds.count:  # a child appears at its first observation
            yield histogram("sglang:kv_transfer_latency_ms", MP, [(labels, pd.transfer_seconds)], multiprocess=True)
            yield histogram("sglang:kv_transfer_total_mb", MP, [(labels, pd.transfer_bytes)], multiprocess=True)
            yield histogram("sglang:kv_transfer_speed_gb_s", MP, [(labels, pd.transfer_speed)], multiprocess=True)
        if pd.failed_transfers:
            yield counter("sglang:num_transfer_failed_reqs_total", MP, [(labels, float(pd.failed_transfers))])


def side_state(model: PDModel, role: str, model_name: str, started_unix: float,
               replica: int = 0) -> tuple[EngineState, PDSideState]:
    """What one side's page (the decode side: replica `replica`'s) shows as of the model's last tick."""
    return (EngineState(model_name, 1, started_unix, (model.snapshot(role, replica),), role),
            _side_state(model, role, replica))


def side_registry(engine: str, state: Callable[[], tuple[EngineState, PDSideState]], seed: int) -> CollectorRegistry:
    """One side's /metrics: the engine's standard families and its P/D families, from `state()` at each scrape."""
    registry = CollectorRegistry()
    registry.register(VllmCollector(lambda: state()[0], VLLM_V1) if engine == "vllm"
                      else SglangCollector(lambda: state()[0], seed))
    registry.register(VllmConnectorCollector(state) if engine == "vllm" else SglangDisaggregationCollector(state))
    return registry


def _decode_name(replica: int) -> str:
    return "decode" if replica == 0 else f"decode-{replica}"


class PDPair:
    """A running pair: `prefill_url` and `decode_url` serve their /metrics; stop it with `.stop()` or `with`.
    `add_decode` starts another decode replica behind the same prefill engine (`decode_urls`: every one's)."""

    def __init__(self, engine: str, scenario: PDScenario, speed: float, seed: int, model_name: str,
                 host: str = "127.0.0.1", ports: tuple[int, int] = (0, 0)):
        self.engine, self.scenario, self.speed = engine, scenario, speed
        flavor = FLAVORS[FLAVOR_OF[engine]]
        self.model = PDModel(scenario, engine == "vllm", flavor.reporting.buckets, seed)
        self.model_name, self.host, self.seed = model_name, host, seed
        self._started_unix = time.time()
        self._started_monotonic = time.monotonic()
        self._lock = threading.Lock()  # the model between the clock's thread and add_decode
        self._states = self._build_states()
        self._stopping = threading.Event()
        self._servers: dict[str, ThreadingHTTPServer] = {}
        self._threads = [threading.Thread(target=self._advance_forever, daemon=True)]
        self.prefill_url, self.decode_url = (self._serve(name, port)
                                             for name, port in zip(("prefill", "decode"), ports))
        self._threads[0].start()

    def _serve(self, name: str, port: int) -> str:
        """One side's /metrics on `port` (0: a free one), from its state at each scrape; its URL."""
        registry = side_registry(self.engine, lambda: self._states[name], self.seed)
        server = self._servers[name] = ThreadingHTTPServer((self.host, port), _handler_for(registry, "/metrics"))
        server.daemon_threads = True
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        self._threads.append(thread)
        thread.start()
        return f"http://{self.host}:{server.server_address[1]}/metrics"

    def add_decode(self, port: int = 0) -> str:
        """Another decode replica, serving its /metrics on `port` (0: a free one) from now on; its URL."""
        with self._lock:
            self.model.add_decode()
            self._states = self._build_states()
        return self._serve(_decode_name(len(self.model.decodes) - 1), port)

    @property
    def decode_urls(self) -> list[str]:
        return [f"http://{self.host}:{self._servers[_decode_name(i)].server_address[1]}/metrics"
                for i in range(len(self.model.decodes)) if _decode_name(i) in self._servers]

    @property
    def sim_time(self) -> float:
        return self.model.now

    def state(self, role: str) -> tuple[EngineState, PDSideState]:
        return self._states[role]

    def _build_states(self) -> dict[str, tuple[EngineState, PDSideState]]:
        return {"prefill": side_state(self.model, "prefill", self.model_name, self._started_unix),
                **{_decode_name(i): side_state(self.model, "decode", self.model_name, self._started_unix, i)
                   for i in range(len(self.model.decodes))}}

    def _advance_forever(self) -> None:
        while not self._stopping.wait(TICK_S):
            target = (time.monotonic() - self._started_monotonic) * self.speed
            with self._lock:
                self.model.advance_to(target)
                self._states = self._build_states()

    def stop(self) -> None:
        if self._stopping.is_set():
            return
        self._stopping.set()
        for server in self._servers.values():
            server.shutdown()
            server.server_close()
        for thread in self._threads:
            thread.join()

    def __enter__(self) -> "PDPair":
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()


def start_pd_pair(engine: str, scenario: str | PDScenario, speed: float = 1.0, seed: int = 0,
                  model: str = "meta-llama/Llama-3.1-8B-Instruct", host: str = "127.0.0.1",
                  ports: tuple[int, int] = (0, 0)) -> PDPair:
    """A prefill and a decode engine of `engine` (vllm or sglang) serving /metrics on `ports` (0: a free one),
    driven by `scenario`."""
    if engine not in FLAVOR_OF:
        raise ValueError(f"P/D pairs are vllm or sglang, got {engine!r}")
    if not speed > 0:
        raise ValueError(f"speed must be > 0, got {speed!r}")
    if isinstance(scenario, str):
        scenario = load_pd_scenario(scenario)
    return PDPair(engine, scenario, speed, seed, model, host, ports)
