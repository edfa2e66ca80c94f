"""The golden P/D pages (tests/fixtures/pd-golden/, written by each engine's own metrics code from story.yml; how,
in devtools/pd_golden.py) read as the story's truth: at every poll, every family of the contract's transfer group
and the queue split equal what the story says in the engines' terms, mapped here by hand (the stages in the same
words for both engines), never by the code under test."""

from __future__ import annotations

import math

import pytest

from devtools import pd_golden
from kvcache_exporter import adapters, contract, derive
from kvcache_exporter.simulator.pd import NIXL_BYTES, NIXL_SECONDS
from kvcache_exporter.sources import parser
from kvcache_exporter.thresholds import DEFAULT as T

# Each test twice: with the adapters' compiled loops and with their pure-Python reference (conftest.py).
pytestmark = pytest.mark.usefixtures("fold")

STORY = pd_golden.story()
POLLS = range(1, len(STORY["vllm"]["decode"]) + 1)
PAGES = [("vllm-pull", "decode"), ("vllm-pull", "prefill"), ("vllm-push", "decode"), ("vllm-push", "prefill"),
         ("sglang", "decode"), ("sglang", "prefill")]
GIB, MIB = 2**30, 2**20
VLLM_BLOCK = 128  # the tiny model's pool on the CPU build (cache_config_info block_size)


def read(index: int, engine: str, role: str):
    text = pd_golden.page_path(index, engine, role).read_text()
    adapter = adapters.detect(text)
    snapshot = adapter.adapt(parser.parse(text, adapter.wanted))
    ranks, _ = derive.derive(snapshot, {}, 0.0, T, role=snapshot.role or role)
    return ranks["0"]


def histogram(values: list[float], bounds: tuple[float, ...], scale: float = 1.0) -> dict:
    """The cumulative histogram the engine's buckets make of `values`, in the contract's unit."""
    buckets = [(bound * scale, float(sum(v <= bound for v in values))) for bound in bounds]
    return {"buckets": [*buckets, (math.inf, float(len(values)))], "sum": sum(values) * scale,
            "count": float(len(values))}


def short(usage: float, running: int, capacity_tokens: float, block: int) -> bool:
    """KV short by the exporter's rule, from the story's numbers: usage at the low-water mark, or less free than
    one running request holds (used tokens in whole blocks)."""
    used = round(usage * capacity_tokens / block) * block if block > 1 else round(usage * capacity_tokens)
    return usage >= T.low_water_ratio or (running > 0 and capacity_tokens - used < used / running)


def queue_truth(running: int, usage: float, to_allocate: int, queue: int, for_capacity: int, is_short: bool,
                decode: bool) -> dict:
    """The queue split and the state: a decode pool's transfers are never room nor a cap."""
    room_queue = for_capacity - to_allocate if decode else for_capacity
    if for_capacity and is_short:
        state = "saturated"
    elif room_queue:
        state = "capped"
    else:
        state = "tight" if usage >= T.high_water_ratio else "ok"
    return {"requests_running": running, "requests_waiting": queue,
            "requests_waiting_for_kv": float(for_capacity if is_short else 0),
            "requests_waiting_with_kv_room": float(0 if is_short else room_queue), "pressure": state}


def vllm_truth(index: int, mode: str, role: str) -> tuple[dict, dict]:
    decode_polls, prefill_polls = STORY["vllm"]["decode"][:index], STORY["vllm"]["prefill"][:index]
    times = (role == "decode") == (mode == "pull")
    observed = [t for poll in decode_polls for t in poll["transfers"]] if times else []
    family = {"kv_transfer_seconds": histogram([s for s, _ in observed], NIXL_SECONDS),
              "kv_transfer_bytes": histogram([b for _, b in observed], NIXL_BYTES),
              # registered per engine at start on every side: a side that counts none reads 0; failures are
              # counted where the transfers are timed (the reader pulling, the writer pushing)
              "kv_transfer_failures_total": {("transfer",): float(sum(p["failed_transfers"] for p in decode_polls)
                                                                  if times else 0),
                                             ("notification",): 0.0},
              "kv_transfer_lease_expiries_total": float(sum(p["expired_leases"] for p in prefill_polls)
                                                        if role == "prefill" else 0),
              "kv_transfer_notifications_after_expiry_total": float(
                  sum(p["notifications_after_expiry"] for p in prefill_polls) if role == "prefill" else 0),
              "kv_transfer_prompt_tokens_total": float(sum(p["received_tokens"] for p in decode_polls)
                                                       if role == "decode" else 0)}
    capacity = (pd_golden.POOL_BLOCKS) * VLLM_BLOCK
    if role == "decode":
        poll = decode_polls[-1]
        stages = {("waiting_to_start",): float(poll["waiting_to_start"]), ("in_progress",): float(poll["in_progress"]),
                  ("completed_waiting",): float(poll["completed_waiting"])}
        is_short = short(poll["usage"], poll["running"], capacity, VLLM_BLOCK)
        family["kv_transfer_requests"] = stages
        family["kv_transfer_requests_waiting_for_kv"] = float(poll["waiting_to_start"] if is_short else 0)
        queue = sum(int(v) for v in stages.values()) + poll["other_deferred"]
        pool = queue_truth(poll["running"], poll["usage"], poll["waiting_to_start"], queue, poll["waiting_to_start"],
                           is_short, True)
        pool["cached_peer"] = float(sum(p["planned_tokens"] for p in decode_polls))
    else:
        poll = prefill_polls[-1]
        is_short = short(poll["usage"], poll["running"], capacity, VLLM_BLOCK)
        pool = queue_truth(poll["running"], poll["usage"], 0, poll["waiting"], poll["waiting"], is_short, False)
        # KV held for the pull: all the used KV while nothing runs; the story finishes no request on this side, so
        # with requests running there is no mean prompt to leave theirs out by.
        if poll["running"] == 0:
            family["kv_transfer_held_tokens"] = float(round(poll["usage"] * capacity / VLLM_BLOCK) * VLLM_BLOCK)
    return family, pool


def sglang_truth(index: int, role: str) -> tuple[dict, dict]:
    polls = STORY["sglang"][role][:index]
    poll = polls[-1]
    is_short = short(poll["usage"], poll["running"], pd_golden.SGLANG_CAPACITY, 1)
    if role == "decode":
        stages = {("waiting_to_start",): float(poll["prealloc"]), ("in_progress",): float(poll["transfer"]),
                  ("completed_waiting",): float(poll["waiting"])}
        family = {"kv_transfer_requests": stages,
                  "kv_transfer_requests_waiting_for_kv": float(poll["prealloc"] if is_short else 0)}
        queue = poll["prealloc"] + poll["transfer"] + poll["waiting"]
        return family, queue_truth(poll["running"], poll["usage"], poll["prealloc"], queue, poll["prealloc"],
                                   is_short, True)
    transfers = [t for p in polls for t in p["transfers"]]  # the stats rank's (TP rank 0)
    speeds = [mib / 1024 / (ms / 1000) for ms, mib in transfers]
    link_bound = min(b for b in pd_golden.SPEED_GB_S if b * GIB >= STORY["link_bytes_per_second"])
    family = {"kv_transfer_seconds": histogram([ms for ms, _ in transfers], pd_golden.LATENCY_MS, 0.001),
              "kv_transfer_bytes": histogram([mib for _, mib in transfers], pd_golden.TOTAL_MB, MIB),
              "kv_transfer_speed_bytes_per_second": histogram(speeds, pd_golden.SPEED_GB_S, GIB),
              "kv_transfer_above_link_total": float(sum(s > link_bound for s in speeds)),
              "kv_transfer_requests": {("waiting_to_start",): float(poll["bootstrap"]),
                                       ("in_progress",): float(poll["inflight"])}}
    failures = {(kind,): float(sum(p[key] for p in polls))
                for kind, key in (("transfer", "transfer_failures"), ("handshake", "bootstrap_failures"))
                if any(p[key] for p in polls)}  # created at the first failure
    if failures:
        family["kv_transfer_failures_total"] = failures
    # KV held while sent: the inflight queue's prompts; the story finishes no request (no mean prompt to count them
    # by), so known only while the queue is empty.
    if poll["inflight"] == 0:
        family["kv_transfer_held_tokens"] = 0.0
    return family, queue_truth(poll["running"], poll["usage"], 0, poll["waiting"], poll["waiting"], is_short, False)


def as_read(rank) -> dict:
    """The rank's transfer-group families, histograms as plain values."""
    out = {}
    for name in contract.names(group="transfer"):
        if name in rank.values.histograms:
            h = rank.values.histograms[name]
            out[name] = {"buckets": [(b, float(c)) for b, c in h.buckets], "sum": h.sum, "count": float(h.count)}
        elif name in rank.values.counters:
            out[name] = float(rank.values.counters[name])
        elif name in rank.gauges:
            out[name] = float(rank.gauges[name])
        elif name in rank.labelled:
            out[name] = {key: float(v) for key, v in rank.labelled[name].items()}
    return out


def approx(value):
    if isinstance(value, dict):
        return {k: approx(v) for k, v in value.items()}
    if isinstance(value, list):
        return [(pytest.approx(b, rel=1e-12), c) for b, c in value]
    return pytest.approx(value, rel=1e-9) if isinstance(value, float) else value


@pytest.mark.parametrize("engine, role", PAGES, ids=lambda p: p)
@pytest.mark.parametrize("index", POLLS)
def test_every_pd_family_equals_the_storys_truth(index, engine, role):
    rank = read(index, engine, role)
    if engine == "sglang":
        family, pool = sglang_truth(index, role)
    else:
        family, pool = vllm_truth(index, engine.split("-")[1], role)
    assert as_read(rank) == approx(family)
    gauges = rank.gauges
    assert {k: gauges[k] for k in ("requests_running", "requests_waiting", "requests_waiting_for_kv",
                                   "requests_waiting_with_kv_room")} == {k: pool[k] for k in (
        "requests_running", "requests_waiting", "requests_waiting_for_kv", "requests_waiting_with_kv_room")}
    assert rank.pressure == pool["pressure"]
    if "cached_peer" in pool:  # vLLM's p2p hits: the loads planned, at admission
        assert rank.labelled["cached_prompt_tokens_total"][("peer",)] == pool["cached_peer"]


def test_the_story_crosses_every_rule():
    """The story is worth checking: transfers waiting to start with KV room and short of it, a prefill queue
    with room (capped), a transfer above the link, failures created mid-story, push and pull timing (and counting
    failures) apart."""
    states = {(engine, role, index): read(index, engine, role).pressure for engine, role in PAGES for index in POLLS}
    assert states["vllm-pull", "decode", 1] == states["sglang", "decode", 1] == "ok"
    assert states["vllm-pull", "decode", 3] == states["sglang", "decode", 3] == "saturated"
    assert states["vllm-pull", "prefill", 1] == states["sglang", "prefill", 1] == "capped"
    assert read(3, "sglang", "prefill").gauges["kv_transfer_above_link_total"] == 1
    assert read(3, "vllm-push", "decode").values.histograms["kv_transfer_seconds"].count == 0
    assert read(3, "vllm-push", "prefill").values.histograms["kv_transfer_seconds"].count == 10
    # the failed transfer is counted where it was driven: the reader's when pulling, the writer's when pushing
    failures = {(engine, role): read(3, engine, role).labelled["kv_transfer_failures_total"][("transfer",)]
                for engine in ("vllm-pull", "vllm-push") for role in ("decode", "prefill")}
    assert failures == {("vllm-pull", "decode"): 1, ("vllm-pull", "prefill"): 0, ("vllm-push", "decode"): 0,
                        ("vllm-push", "prefill"): 1}
