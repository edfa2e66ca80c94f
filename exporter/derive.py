"""Pure functions from normalized snapshots (this poll and earlier ones) to the derived series.

Nothing here does I/O or keeps state: the caller hands in the previous history and gets the
new one back, which keeps every rule testable on plain values.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .contract import KV_SHORT_STATES, PRESSURE_REASONS
from .snapshot import RankValues, Snapshot
from .thresholds import Thresholds

# (poll time, a cumulative counter's value) points of one rank, oldest first, within the window.
History = tuple[tuple[float, float], ...]


@dataclass(frozen=True, slots=True)
class RankHistory:
    """One rank's counters over the window, kept from poll to poll: its preemptions (the pressure state's rate) and,
    on a prefill pool that holds KV for export, its prompt tokens and finished requests, read at the same polls (the
    recent mean prompt, prompt_tokens_per_request)."""

    preemptions: History = ()
    prompt_tokens: History = ()
    finished_requests: History = ()


NO_HISTORY = RankHistory()  # a rank's first poll


@dataclass(slots=True)
class DerivedRank:
    gauges: dict[str, float]  # derived values by contract name without the `kvcache_` prefix (gauges, and
    # kv_transfer_above_link_total: a count derived from a histogram)
    values: RankValues  # the adapter's counters and histograms, passed through
    pressure: str | None
    reason: str | None = None  # why: a key of contract.PRESSURE_REASONS
    # The adapter's labelled families, each tier's usage completed (tier_values).
    labelled: dict[str, dict[tuple[str, ...], float]] = field(default_factory=dict)


def _whole(value: float, rounding) -> float:
    """A whole count; an overflowing product (absurd readings) stays infinite, to be dropped."""
    return float(rounding(value)) if math.isfinite(value) else value


def kv_gauges(rank: RankValues, bytes_per_token: int | None = None,
              export_hold: str | None = None, recent: RankHistory = NO_HISTORY) -> dict[str, float]:
    """Capacity, used and free in blocks and tokens, KV held for export (a prefill pool's, `export_hold`: how its
    engine holds it, held_for_export, with its `recent` counters), and live tokens per request, from what the
    engine gave.

    Block counts come from the usage ratio where the engine reports blocks (vLLM), from its used-block
    count where it reports one (TensorRT-LLM, Triton), and from token counts where it reports tokens
    (SGLang); a value whose inputs are missing stays absent. Live tokens are the running requests' own: KV held
    for export belongs to requests that no longer run.
    """
    given = rank.gauges
    out = {k: v for k, v in given.items() if k != "used_tokens"}
    block = given.get("block_size_tokens")
    blocks = given.get("capacity_blocks")
    tokens = given.get("capacity_tokens")
    if blocks is None and tokens and block:
        blocks = float(tokens // block)
    if tokens is None and blocks is not None and block:
        tokens = blocks * block
    usage = given.get("usage_ratio")
    used_tokens = given.get("used_tokens")
    used_blocks = given.get("used_blocks")  # engines that count blocks (TensorRT-LLM, Triton)
    if used_tokens is None and used_blocks is not None and block:
        used_tokens = used_blocks * block
    if used_tokens is not None:
        if blocks is not None and block:
            used_blocks = min(blocks, _whole(used_tokens / block, math.ceil))
        if usage is None and tokens:
            usage = used_tokens / tokens
    elif usage is not None and blocks is not None:
        used_blocks = used_blocks if used_blocks is not None else _whole(usage * blocks, round)
        if block:
            used_tokens = used_blocks * block
    elif usage is not None and tokens is not None:
        used_tokens = _whole(usage * tokens, round)
    if block and "prefix_cache_min_hit_tokens" not in out:  # hits land on whole blocks
        out["prefix_cache_min_hit_tokens"] = block
    for name, value in (("capacity_blocks", blocks), ("capacity_tokens", tokens), ("usage_ratio", usage)):
        if value is not None:
            out[name] = value
    if used_blocks is not None and blocks is not None:
        out["used_blocks"] = used_blocks
        out["free_blocks"] = blocks - used_blocks
    if used_tokens is not None:
        out["used_tokens"] = used_tokens
        if tokens is not None:
            out["free_tokens"] = max(0.0, tokens - used_tokens)
    running = given.get("requests_running")
    held = held_for_export(rank, used_tokens, export_hold, recent)
    if held is not None:
        out["kv_transfer_held_tokens"] = held
    if used_tokens is not None and running:
        live = out["live_tokens_per_request"] = (used_tokens - (held or 0.0)) / running
        if live > 0 and "free_tokens" in out:
            out["headroom_requests"] = out["free_tokens"] / live
    if bytes_per_token is not None:
        out["bytes_per_token"] = float(bytes_per_token)
        for name in ("capacity", "used"):
            if f"{name}_tokens" in out:
                out[f"{name}_bytes"] = out[f"{name}_tokens"] * bytes_per_token
    # Finite readings can still multiply past float range: such a value is no value.
    return {name: value for name, value in out.items() if math.isfinite(value)}


def finished_requests(rank: RankValues) -> float | None:
    """Requests finished over the engine's life: its finished-request counter, else its end-to-end latency count
    (both counted as a request finishes: vLLM's PrometheusStatLogger.record for each finished request, SGLang's
    observe_one_finished_request), so the count stands while the latency group is turned off."""
    counted = rank.counters.get("requests_finished_total")
    if counted is not None:
        return counted
    latency = rank.histograms.get("e2e_request_latency_seconds")
    return None if latency is None else latency.count


def prompt_tokens_per_request(rank: RankValues, recent: RankHistory = NO_HISTORY) -> float | None:
    """Prompt tokens per finished request: the prompt token counter's increase over the finished requests' across
    the window (`recent`, a decrease adding nothing, as in rate), so that a shift of prompt lengths shows within
    one window; over the engine's life where no request finished within the window. Both are counted as a request
    finishes on a prefill pool (vLLM's at its one token, SGLang's once its transfer is done). None before the first
    request finished, or without either reading."""
    finished = increase(recent.finished_requests)
    if finished > 0:
        return increase(recent.prompt_tokens) / finished
    prompt, finished = rank.counters.get("prompt_tokens_total"), finished_requests(rank)
    if prompt is None or finished is None or not finished > 0:
        return None
    return prompt / finished


def held_for_export(rank: RankValues, used_tokens: float | None, export_hold: str | None,
                    recent: RankHistory = NO_HISTORY) -> float | None:
    """A prefill pool's KV tokens held only until the decode side has them, by how its engine holds them
    (`export_hold`, contract.EXPORT_HOLDS); None where the pool holds none for export (`export_hold` None: not a
    prefill pool, or an engine whose hold is not known) or a reading is missing.

    - finished (vLLM): Scheduler._free_request asks the connector (_connector_finished -> request_finished), which
      delays freeing a finished request's blocks until the decode side has pulled them (or their lease ran out);
      such a request is neither running nor waiting, and its blocks are in the usage. Held: the used tokens beyond
      what the running requests hold, each taken as one prompt of the pool's recent mean (prompt_tokens_per_request);
      exact while nothing runs.
    - inflight (SGLang): process_batch_result_disagg_prefill moves a computed request into the inflight queue with
      its KV still allocated, and process_disagg_prefill_inflight_queue releases it once the transfer is done.
      Held: that queue (the in_progress stage) times the mean prompt, no more than the used tokens.
    """
    if export_hold is None or used_tokens is None:
        return None
    if export_hold == "inflight":
        holding = rank.labelled.get("kv_transfer_requests", {}).get(("in_progress",))
    else:
        holding = rank.gauges.get("requests_running")
    if holding is None:
        return None
    per_prompt = prompt_tokens_per_request(rank, recent) if holding else 0.0
    if per_prompt is None:
        return None
    if export_hold == "inflight":
        return min(used_tokens, holding * per_prompt)
    return max(0.0, used_tokens - holding * per_prompt)


def tier_values(labelled: dict[str, dict[tuple[str, ...], float]]) -> dict[str, dict[tuple[str, ...], float]]:
    """Each offload tier's used tokens and usage ratio from whichever of the two the engine gives, with
    its capacity (vLLM reports a ratio, SGLang token counts); a value whose inputs are missing stays absent."""
    out = {name: dict(values) for name, values in labelled.items()}
    capacity = labelled.get("tier_capacity_tokens", {})
    used = out.setdefault("tier_used_tokens", {})
    ratio = out.setdefault("tier_usage_ratio", {})
    for tier, tokens in capacity.items():
        if tier in ratio and tier not in used:
            used[tier] = _whole(ratio[tier] * tokens, round)
        elif tier in used and tier not in ratio and tokens > 0:
            ratio[tier] = used[tier] / tokens
    return {name: {k: v for k, v in values.items() if math.isfinite(v)} for name, values in out.items() if values}


def extend_history(history: History, now: float, value: float | None, window: float) -> History:
    """Append this poll's counter value and drop points older than the window (one older point kept as base)."""
    if value is None:
        return ()
    points = history + ((now, value),)
    cutoff = now - window
    first = 0
    while first + 1 < len(points) and points[first + 1][0] <= cutoff:
        first += 1
    return points[first:]


def increase(history: History) -> float:
    """The counter's increase over the history. A decrease is a counter reset (engine restart):
    that step adds nothing, so a restart can never look like a burst or a negative rate."""
    return sum(max(0.0, b[1] - a[1]) for a, b in zip(history, history[1:]))


def rate(history: History) -> float | None:
    """Per-second increase over the history (increase)."""
    if len(history) < 2:
        return None
    span = history[-1][0] - history[0][0]
    return increase(history) / span if span > 0 else None


def preempted_since_last_poll(history: History) -> bool:
    """Whether the preemption counter rose between the last two polls (a drop is a restart, not a preemption)."""
    return len(history) >= 2 and history[-1][1] > history[-2][1]


def kv_short_reason(gauges: dict[str, float], thresholds: Thresholds, preempted: bool = False,
                    preemption_rate: float | None = None) -> str | None:
    """Why the KV pool is what would hold a queued request back (a reason of contract.PRESSURE_REASONS), None
    while it has room: preemptions at the thrashing rate over the window (between two preemptions the freed
    blocks make the pool look roomy, and the queue waits for KV all the same: seen on the real vLLM tier at
    40 % usage with 26 queued for capacity), usage at or above the low-water mark (the pool no longer has room
    to spare), fewer free tokens than one typical live request holds, or the engine preempted since the last
    poll (it does so only when it cannot grow a running request's KV; the blocks it freed make the pool look
    roomy until the queue is readmitted). Not the high-water mark: engines admit a request only if its prompt
    fits next to a reserve for the running requests' future output (SGLang's new_token_ratio), so a queue waits for KV
    already at 80-89 % usage with several typical requests' worth free (the simulator's kv-saturation
    ramp shows it; a queue behind the running cap sits far lower). While nothing runs the typical
    request is unknown and only the mark decides."""
    if preemption_rate is not None and preemption_rate >= thresholds.thrashing_preemptions_per_second:
        return "preemptions"
    if gauges.get("usage_ratio", 0.0) >= thresholds.low_water_ratio:
        return "low_water"
    free, live = gauges.get("free_tokens"), gauges.get("live_tokens_per_request")
    if free is not None and live is not None and free < live:
        return "free_below_request"
    return "preempted" if preempted else None


def kv_is_short(gauges: dict[str, float], thresholds: Thresholds, preempted: bool = False,
                preemption_rate: float | None = None) -> bool:
    """Whether the KV pool is what would hold a queued request back (kv_short_reason)."""
    return kv_short_reason(gauges, thresholds, preempted, preemption_rate) is not None


def decode_stages(labelled: dict[str, dict[tuple[str, ...], float]], role: str) -> dict[str, float]:
    """A decode pool's queued requests by KV transfer stage (contract.TRANSFER_STAGES); {} on other roles, whose
    stages (SGLang's prefill queues, a unified vLLM pool's loads from its offload tier) are not in its queue."""
    if role != "decode":
        return {}
    return {key[0]: value for key, value in labelled.get("kv_transfer_requests", {}).items()}


def _waiting_for_capacity(gauges: dict[str, float], stages: dict[str, float]) -> tuple[float, float]:
    """The queue the pressure state looks at, and the part of it that is transfers waiting for their KV to be
    allocated (a decode pool's waiting_to_start stage).

    The queue is vLLM's `capacity` reason, else (SGLang) the whole queue less the transfers that hold their KV
    already (in_progress, completed_waiting): those wait for the transfer or for their turn to run, not for KV
    or a cap. vLLM's `capacity` reason never holds them: its scheduler defers a request once its load has started
    (Scheduler.schedule's skip_request, counted as `deferred` by Scheduler.make_stats), while a request whose
    load waits for blocks stays in the plain waiting queue."""
    held = stages.get("in_progress", 0.0) + stages.get("completed_waiting", 0.0)
    queue = gauges.get("requests_waiting_for_capacity")
    if queue is None:
        queue = max(0.0, gauges.get("requests_waiting", 0.0) - held)
    return queue, min(queue, stages.get("waiting_to_start", 0.0))


def waiting_split(gauges: dict[str, float], kv_short: bool,
                  stages: dict[str, float] | None = None) -> dict[str, float]:
    """The queue split by cause: waiting for KV (the queue for capacity while KV is short, `kv_short` as
    kv_is_short decides, else 0) and waiting
    with KV room (the queue for capacity while KV has room, less a decode pool's transfers waiting to start:
    a transfer is never evidence of room). The rest of the queue waits for something else (vLLM's deferred
    reasons, transfers under way or done). Absent without a usage or a queue reading."""
    waiting = gauges.get("requests_waiting")
    if waiting is None or "usage_ratio" not in gauges:
        return {}
    queue, to_allocate = _waiting_for_capacity(gauges, stages or {})
    if kv_short:
        return {"requests_waiting_for_kv": min(waiting, queue), "requests_waiting_with_kv_room": 0.0}
    return {"requests_waiting_for_kv": 0.0, "requests_waiting_with_kv_room": min(waiting, queue - to_allocate)}


def transfer_waiting_for_kv(gauges: dict[str, float], stages: dict[str, float], kv_short: bool) -> dict[str, float]:
    """A decode pool's transfers that cannot start for want of KV: its waiting_to_start stage while KV is
    short (`kv_short`, as kv_is_short decides), else 0. The decode half of P/D backpressure: the prefill side
    holds those requests' KV (vLLM, until pulled) or waits to compute them (SGLang, until the decode side
    pre-allocates). Absent on other roles and without a stage or usage reading."""
    waiting = stages.get("waiting_to_start")
    if waiting is None or "usage_ratio" not in gauges:
        return {}
    return {"kv_transfer_requests_waiting_for_kv": waiting if kv_short else 0.0}


def pressure_reason(gauges: dict[str, float], preemption_rate: float | None, thresholds: Thresholds,
                    preempted: bool = False, stages: dict[str, float] | None = None) -> str | None:
    """Why a pool is in its KV pressure state (a reason of contract.PRESSURE_REASONS, whose `state` is the
    state); the first rule that holds wins.

    1. thrashing (preemptions): preemptions/retractions at or above the threshold rate.
    2. saturated: requests wait for capacity (vLLM's `capacity` reason, else the whole queue; on a decode
       pool neither holds transfers under way or done) AND the KV pool is short (kv_short_reason: usage at
       the low-water mark or above, fewer free tokens than a typical live request holds, or a preemption
       since the last poll).
    3. capped (cap): requests other than a decode pool's transfers waiting to start wait for capacity while
       the KV pool has room (usage below the low-water mark and free tokens >= a typical live request): the
       running-request cap or the token budget binds, not KV. vLLM reports `capacity` for the running cap too
       (reference §7) and SGLang gives no reason at all, so for SGLang this state is what tells the two queues
       apart. A transfer waiting to start while KV has room is no evidence of a cap (vLLM counts one from its
       arrival, before the scheduler has looked at it). With none running no cap binds (admits_nothing): the
       engine admits nothing, for one poll at a burst's first instant, for minutes when it is wedged.
    4. tight (high_water): usage at or above the high-water mark, nothing waiting for capacity.
    5. ok (room): otherwise. None when the engine reports no usage at all.
    capped needs usage below the low-water mark and tight at or above the high-water mark, so the
    two never compete.
    """
    usage = gauges.get("usage_ratio")
    if usage is None:
        return None
    if preemption_rate is not None and preemption_rate >= thresholds.thrashing_preemptions_per_second:
        return "preemptions"
    queue, to_allocate = _waiting_for_capacity(gauges, stages or {})
    short = kv_short_reason(gauges, thresholds, preempted) if queue > 0 else None
    if short is not None:
        return short
    if queue - to_allocate > 0:
        return "admits_nothing" if gauges.get("requests_running") == 0 else "cap"
    if usage >= thresholds.high_water_ratio:
        return "high_water"
    return "room"


def pressure_state(gauges: dict[str, float], preemption_rate: float | None, thresholds: Thresholds,
                   preempted: bool = False, stages: dict[str, float] | None = None) -> str | None:
    """The KV pressure state of one pool: its reason's (pressure_reason)."""
    reason = pressure_reason(gauges, preemption_rate, thresholds, preempted, stages)
    return None if reason is None else PRESSURE_REASONS[reason].state


def transfers_above_link(values: RankValues, thresholds: Thresholds) -> dict[str, float]:
    """The transfers whose speed the engine reported above the link rate, from its per-transfer speed histogram:
    those above the smallest bucket bound at or above the link rate. Absent without such a histogram."""
    speed = values.histograms.get("kv_transfer_speed_bytes_per_second")
    if speed is None:
        return {}
    link = thresholds.kv_transfer_link_bytes_per_second
    at_or_below = next(cumulative for bound, cumulative in speed.buckets if bound >= link)  # +Inf ends the list
    return {"kv_transfer_above_link_total": max(0.0, speed.count - at_or_below)}


def extend_rank_history(history: RankHistory, rank: RankValues, now: float, window: float,
                        holds_for_export: bool) -> RankHistory:
    """A rank's histories with this poll's counters; the prompt and finished-request counters only where the pool
    holds KV for export, and both or neither, so that the two cover the same polls."""
    preemptions = extend_history(history.preemptions, now, rank.counters.get("preemptions_total"), window)
    prompt, finished = rank.counters.get("prompt_tokens_total"), finished_requests(rank)
    if not holds_for_export or prompt is None or finished is None:
        return RankHistory(preemptions)
    return RankHistory(preemptions, extend_history(history.prompt_tokens, now, prompt, window),
                       extend_history(history.finished_requests, now, finished, window))


def derive(
    snapshot: Snapshot, histories: dict[str, RankHistory], now: float, thresholds: Thresholds,
    bytes_per_token: int | None = None, role: str = "unified",
) -> tuple[dict[str, DerivedRank], dict[str, RankHistory]]:
    """Derived series of every rank of a snapshot (its pools' disaggregation role `role`), and the rank
    histories to keep for the next poll."""
    derived: dict[str, DerivedRank] = {}
    new_histories: dict[str, RankHistory] = {}
    export_hold = snapshot.export_hold if role == "prefill" else None
    for rank_name, rank in snapshot.ranks.items():
        recent = new_histories[rank_name] = extend_rank_history(
            histories.get(rank_name, NO_HISTORY), rank, now, thresholds.window_seconds, export_hold is not None)
        history = recent.preemptions
        gauges = kv_gauges(rank, bytes_per_token, export_hold, recent)
        preempted = preempted_since_last_poll(history)
        stages = decode_stages(rank.labelled, role)
        preemption_rate = rate(history)
        kv_short = kv_is_short(gauges, thresholds, preempted, preemption_rate)
        gauges.update(waiting_split(gauges, kv_short, stages))
        gauges.update(transfer_waiting_for_kv(gauges, stages, kv_short))
        gauges.update(transfers_above_link(rank, thresholds))
        reason = pressure_reason(gauges, preemption_rate, thresholds, preempted, stages)
        state = None if reason is None else PRESSURE_REASONS[reason].state
        if state in KV_SHORT_STATES and "headroom_requests" in gauges:
            gauges["headroom_requests"] = 0.0  # the queue waits for KV: what is free is no room it is admitted into
        derived[rank_name] = DerivedRank(gauges, rank, state, reason, tier_values(rank.labelled))
    return derived, new_histories
