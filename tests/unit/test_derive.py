"""Derivation rules on plain values: KV arithmetic, counter resets, the pressure state."""

from __future__ import annotations

import math

import pytest

from kvcache_exporter import derive
from kvcache_exporter.snapshot import Histogram, RankValues, Snapshot
from kvcache_exporter.thresholds import Thresholds

T = Thresholds()


def rank(**gauges) -> RankValues:
    return RankValues(gauges={k: float(v) for k, v in gauges.items()})


def test_vllm_blocks_from_usage_and_capacity():
    gauges = derive.kv_gauges(rank(usage_ratio=0.25, capacity_blocks=8000, block_size_tokens=16, requests_running=10))
    assert gauges["used_blocks"] == 2000 and gauges["free_blocks"] == 6000
    assert gauges["capacity_tokens"] == 128000
    assert gauges["used_tokens"] == 32000 and gauges["free_tokens"] == 96000
    assert gauges["live_tokens_per_request"] == 3200


def test_engines_that_count_used_blocks_keep_their_count():
    """TensorRT-LLM and Triton report used blocks: tokens follow from them, and the count is not
    recomputed from a usage ratio that rounds (Triton's fraction) or disagrees."""
    gauges = derive.kv_gauges(rank(usage_ratio=0.49, capacity_blocks=8000, used_blocks=4000, block_size_tokens=64,
                                   requests_running=60))
    assert (gauges["used_blocks"], gauges["free_blocks"]) == (4000, 4000)
    assert (gauges["used_tokens"], gauges["free_tokens"]) == (256000, 256000)  # 4000 x 64, 8000 x 64 - 256000
    assert gauges["usage_ratio"] == 0.49  # as the engine reports it
    # without a usage gauge (Triton before v0.18) usage is used / capacity: 800 x 128 / (8000 x 128)
    assert derive.kv_gauges(rank(capacity_blocks=8000, used_blocks=800, block_size_tokens=128))["usage_ratio"] == 0.1
    # without a block size the reported count still stands
    assert derive.kv_gauges(rank(usage_ratio=0.49, capacity_blocks=8000, used_blocks=4000))["used_blocks"] == 4000


def test_without_a_preemption_counter_a_full_pool_never_reads_thrashing():
    """TensorRT-LLM, Triton, LMDeploy: the rate is unknown (no history), so the state is what the queue says."""
    snapshot = Snapshot("trtllm", "m", "", {"0": rank(usage_ratio=0.99, capacity_blocks=100, requests_waiting=9)})
    histories: dict = {}
    for now in (0.0, 15.0, 30.0):
        derived, histories = derive.derive(snapshot, histories, now, T)
    assert derived["0"].pressure == "saturated"
    assert histories["0"].preemptions == ()


def test_a_thrashing_pool_queues_for_kv_between_two_preemptions():
    """Preemptions at 6 in 30 s (0.2/s, the threshold 0.02/s) and none since the last poll: the blocks they freed
    leave the pool at 40 % with room for a typical request, and the 26 queued for capacity still wait for KV (the
    real vLLM tier read them as waiting with KV room beside a thrashing state)."""
    histories: dict = {}
    for now, preemptions in ((0.0, 0), (15.0, 6), (30.0, 6)):
        pool = RankValues(gauges={"usage_ratio": 0.4, "capacity_blocks": 15.0, "block_size_tokens": 32.0,
                                  "requests_running": 2.0, "requests_waiting": 26.0,
                                  "requests_waiting_for_capacity": 26.0},
                          counters={"preemptions_total": float(preemptions)})
        derived, histories = derive.derive(Snapshot("vllm", "m", "", {"0": pool}), histories, now, T)
    gauges = derived["0"].gauges
    assert derived["0"].pressure == "thrashing"
    assert (gauges["requests_waiting_for_kv"], gauges["requests_waiting_with_kv_room"]) == (26, 0)
    assert gauges["headroom_requests"] == 0


def test_sglang_tokens_from_raw_pool_gauges():
    gauges = derive.kv_gauges(rank(usage_ratio=0.31, capacity_tokens=100000, block_size_tokens=1,
                                   used_tokens=30500, evictable_tokens=20000, requests_running=5))
    assert gauges["capacity_blocks"] == 100000
    assert (gauges["used_tokens"], gauges["free_tokens"]) == (30500, 69500)  # evictable counts as free
    assert (gauges["used_blocks"], gauges["free_blocks"]) == (30500, 69500)
    assert gauges["usage_ratio"] == 0.31  # as the engine reports it
    assert gauges["evictable_tokens"] == 20000
    assert gauges["live_tokens_per_request"] == 6100


def test_pages_round_up_to_whole_pages():
    gauges = derive.kv_gauges(rank(capacity_tokens=1000, block_size_tokens=16, used_tokens=33))
    assert gauges["capacity_blocks"] == 62
    assert gauges["used_blocks"] == 3


def test_bytes_from_tokens_when_the_architecture_is_known():
    gauges = derive.kv_gauges(rank(usage_ratio=0.5, capacity_blocks=1000, block_size_tokens=16), 131072)
    assert gauges["bytes_per_token"] == 131072
    assert gauges["capacity_bytes"] == 16000 * 131072
    assert gauges["used_bytes"] == 8000 * 131072


def test_missing_inputs_stay_absent():
    gauges = derive.kv_gauges(rank(usage_ratio=0.5, requests_running=0))
    assert set(gauges) == {"usage_ratio", "requests_running"}


def test_rate_ignores_a_counter_reset():
    history = ((0.0, 100.0), (5.0, 110.0), (10.0, 3.0), (15.0, 5.0))
    assert derive.rate(history) == pytest.approx((10 + 0 + 2) / 15)


def test_rate_needs_two_points():
    assert derive.rate(((0.0, 5.0),)) is None


def test_history_keeps_one_point_before_the_window():
    history = ()
    for t in range(0, 100, 5):
        history = derive.extend_history(history, float(t), float(t), window=30)
    assert history[0][0] == 65.0 and history[-1][0] == 95.0


@pytest.mark.parametrize("gauges, preemption_rate, expected", [
    ({"usage_ratio": 0.3}, 0.0, "ok"),
    ({"usage_ratio": 0.93}, 0.0, "tight"),
    # KV full and requests waiting for capacity: the shortage
    ({"usage_ratio": 0.96, "requests_waiting": 4, "requests_waiting_for_capacity": 4}, 0.0, "saturated"),
    # the running cap binds while KV has room: vLLM still says `capacity`; the queue is not KV's
    ({"usage_ratio": 0.4, "requests_waiting": 30, "requests_waiting_for_capacity": 30}, 0.0, "capped"),
    # SGLang gives no reason: with room in the pool (5000 free >= 1000 per request) the state says it is the cap
    ({"usage_ratio": 0.5, "requests_waiting": 10, "free_tokens": 5000, "live_tokens_per_request": 1000}, None,
     "capped"),
    # exactly one typical request still fits: room, so capped; one token less: KV is short
    ({"usage_ratio": 0.5, "requests_waiting": 1, "free_tokens": 1000, "live_tokens_per_request": 1000}, None,
     "capped"),
    ({"usage_ratio": 0.5, "requests_waiting": 1, "free_tokens": 999, "live_tokens_per_request": 1000}, None,
     "saturated"),
    # room means under the low-water mark (0.75): at it a queue waits for KV, just under it is capped
    ({"usage_ratio": 0.75, "requests_waiting": 1}, None, "saturated"),
    ({"usage_ratio": 0.7499, "requests_waiting": 1}, None, "capped"),
    # 0.85 with several typical requests' worth free (3000 >= 4 x 700): engines reserve room for the
    # running requests' output, so this queue waits for KV all the same
    ({"usage_ratio": 0.85, "requests_waiting": 3, "free_tokens": 3000, "live_tokens_per_request": 700}, None,
     "saturated"),
    # only deferred requests (LoRA, KV transfer) wait while KV has room: nothing waits for capacity
    ({"usage_ratio": 0.4, "requests_waiting": 2, "requests_waiting_for_capacity": 0}, None, "ok"),
    # thrashing outranks capped: at the threshold rate (0.02/s) thrashing, just under it capped
    ({"usage_ratio": 0.4, "requests_waiting": 5}, 0.02, "thrashing"),
    ({"usage_ratio": 0.4, "requests_waiting": 5}, 0.0199, "capped"),
    # queued for other reasons (deferred: LoRA, KV transfer) while KV is full: not a KV shortage
    ({"usage_ratio": 0.95, "requests_waiting": 3, "requests_waiting_for_capacity": 0}, 0.0, "tight"),
    # no reason breakdown (SGLang): the whole queue counts
    ({"usage_ratio": 0.97, "requests_waiting": 2}, None, "saturated"),
    # under the high-water mark, but a typical live request no longer fits in what is free
    ({"usage_ratio": 0.8, "requests_waiting": 2, "free_tokens": 1000, "live_tokens_per_request": 3000}, None,
     "saturated"),
    ({"usage_ratio": 0.99, "requests_waiting": 5}, 0.5, "thrashing"),
    ({"usage_ratio": 0.5}, 0.01, "ok"),  # below the thrashing rate
    ({}, 1.0, None),  # no usage reported: no state rather than a guess
])
def test_pressure_state(gauges, preemption_rate, expected):
    assert derive.pressure_state(gauges, preemption_rate, T) == expected


@pytest.mark.parametrize("gauges, expected", [
    # vLLM, KV full: the 6 queued for capacity wait for KV; the 1 deferred request waits for something else
    # (a KV transfer, a LoRA slot, a grammar), neither for KV nor with KV room
    ({"usage_ratio": 0.97, "requests_waiting": 7, "requests_waiting_for_capacity": 6}, (6, 0)),
    # vLLM with room: only the capacity reason's 2 wait with KV room, not the 5 deferred
    ({"usage_ratio": 0.4, "requests_waiting": 7, "requests_waiting_for_capacity": 2}, (0, 2)),
    # vLLM behind the running cap (usage 0.4 < 0.75, no typical request known): all 30 wait with KV room
    ({"usage_ratio": 0.4, "requests_waiting": 30, "requests_waiting_for_capacity": 30}, (0, 30)),
    # SGLang (no reason), KV short by free tokens (999 < 1000 per request): the whole queue waits for KV
    ({"usage_ratio": 0.5, "requests_waiting": 5, "free_tokens": 999, "live_tokens_per_request": 1000}, (5, 0)),
    # SGLang with room (1000 >= 1000): the whole queue waits with KV room
    ({"usage_ratio": 0.5, "requests_waiting": 5, "free_tokens": 1000, "live_tokens_per_request": 1000}, (0, 5)),
    # the reason gauge read a step later than the queue (4 for capacity, 3 waiting): never more than the queue
    ({"usage_ratio": 0.95, "requests_waiting": 3, "requests_waiting_for_capacity": 4}, (3, 0)),
    ({"usage_ratio": 0.95, "requests_waiting": 0}, (0, 0)),
])
def test_waiting_split(gauges, expected):
    split = derive.waiting_split(gauges, derive.kv_is_short(gauges, T))
    assert (split["requests_waiting_for_kv"], split["requests_waiting_with_kv_room"]) == expected


@pytest.mark.parametrize("gauges", [{"requests_waiting": 3.0}, {"usage_ratio": 0.5}])
def test_waiting_split_needs_usage_and_queue(gauges):
    assert derive.waiting_split(gauges, kv_short=True) == {}


def test_headroom_in_typical_requests():
    # vLLM: 8000 blocks x 16 = 128000 tokens, used 0.25 x 8000 = 2000 blocks = 32000 tokens, free 96000;
    # live 32000 / 10 = 3200 per request, so 96000 / 3200 = 30 more requests fit
    vllm = derive.kv_gauges(rank(usage_ratio=0.25, capacity_blocks=8000, block_size_tokens=16, requests_running=10))
    assert vllm["headroom_requests"] == 30
    # SGLang: free 100000 - 30500 = 69500 tokens, live 30500 / 5 = 6100: 69500 / 6100 = 11.39344262295082
    sglang = derive.kv_gauges(rank(capacity_tokens=100000, block_size_tokens=1, used_tokens=30500, requests_running=5))
    assert sglang["headroom_requests"] == pytest.approx(69500 / 6100, rel=1e-12)


@pytest.mark.parametrize("running, used_tokens", [(0, 0), (4, 0)])
def test_headroom_absent_without_a_typical_request(running, used_tokens):
    # nothing runs, or what runs holds no KV yet: no typical size to divide by
    gauges = derive.kv_gauges(rank(capacity_tokens=1000, block_size_tokens=1, used_tokens=used_tokens,
                                   requests_running=running))
    assert "headroom_requests" not in gauges


def test_derive_exposes_the_waiting_split():
    values = rank(usage_ratio=0.25, capacity_blocks=8000, block_size_tokens=16, requests_running=8,
                  requests_waiting=40, requests_waiting_for_capacity=40)
    ranks, _ = derive.derive(Snapshot("vllm", "m", "", {"0": values}), {}, 0.0, T)
    assert ranks["0"].pressure == "capped"
    assert (ranks["0"].gauges["requests_waiting_for_kv"], ranks["0"].gauges["requests_waiting_with_kv_room"]) == (0, 40)
    # 96000 free tokens / (32000 / 8 = 4000 per request) = 24
    assert ranks["0"].gauges["headroom_requests"] == 24


def test_derive_carries_histories_between_polls():
    def snapshot(preemptions: float) -> Snapshot:
        values = rank(usage_ratio=0.99, requests_waiting=3, capacity_blocks=100, block_size_tokens=16)
        values.counters["preemptions_total"] = preemptions
        return Snapshot("vllm", "m", "", {"0": values})

    histories: dict = {}
    states = []
    for t, preemptions in enumerate([0, 0, 0, 4, 9, 3]):  # the last poll follows an engine restart
        ranks, histories = derive.derive(snapshot(preemptions), histories, t * 5.0, T)
        states.append(ranks["0"].pressure)
    assert states == ["saturated", "saturated", "saturated", "thrashing", "thrashing", "thrashing"]
    assert derive.rate(histories["0"].preemptions) == pytest.approx(9 / 25)


def test_a_queue_right_after_a_preemption_waits_for_kv_though_the_freed_blocks_look_like_room():
    """vLLM preempts only when it cannot grow a running request's KV; the preempted requests' blocks are free
    until the next step readmits the queue, so the poll that follows reads room (usage 0.5) and a queue. One
    preemption in a minute is under the thrashing rate (1/60 < 0.02/s): the queue reads as waiting for KV,
    not capped, for that poll; the next poll without a preemption reads the cap again. A restart's drop of the
    counter is no preemption."""
    def snapshot(preemptions: float) -> Snapshot:
        values = rank(usage_ratio=0.5, requests_waiting=2, requests_waiting_for_capacity=2, capacity_blocks=100,
                      block_size_tokens=16)
        values.counters["preemptions_total"] = preemptions
        return Snapshot("vllm", "m", "", {"0": values})

    histories: dict = {}
    seen = []
    for t, preemptions in enumerate([7] * 12 + [8, 8, 2]):  # one preemption at poll 12, a restart at poll 14
        ranks, histories = derive.derive(snapshot(preemptions), histories, t * 5.0, T)
        seen.append((ranks["0"].pressure, ranks["0"].gauges["requests_waiting_for_kv"]))
    assert seen[11:] == [("capped", 0), ("saturated", 2), ("capped", 0), ("capped", 0)]


def _decode_page(engine: str, usage: float, running: int, to_allocate: int, receiving: int, received: int) -> str:
    """A decode server's page as the engine's own metrics code fills it, its queue all KV transfers: vLLM's
    Scheduler.make_stats counts the to_allocate ones under reason `capacity` (still in the plain waiting queue)
    and the others under `deferred` (skip_request defers a request once its load started); SGLang's
    log_decode_stats sets the pre-allocation, transfer and waiting queues' lengths (a decode server's waiting
    queue holds the received ones)."""
    if engine == "vllm":
        labels = 'engine="0",model_name="m"'
        stages = {"waiting_to_start": to_allocate, "in_progress": receiving, "completed_waiting": received}
        return "\n".join([
            f"vllm:kv_cache_usage_perc{{{labels}}} {usage}",
            f"vllm:num_requests_running{{{labels}}} {running}",
            f"vllm:num_requests_waiting{{{labels}}} {to_allocate + receiving + received}",
            f'vllm:num_requests_waiting_by_reason{{{labels},reason="capacity"}} {to_allocate}',
            f'vllm:num_requests_waiting_by_reason{{{labels},reason="deferred"}} {receiving + received}',
            *(f'vllm:num_requests_kv_fetch_by_stage{{{labels},stage="{s}"}} {n}' for s, n in stages.items()),
            'vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="1001"} 1.0', ""])
    labels = 'engine_type="decode",model_name="m",tp_rank="0"'
    return "\n".join([
        f"sglang:token_usage{{{labels}}} {usage}",
        f"sglang:num_running_reqs{{{labels}}} {running}",
        f"sglang:max_total_num_tokens{{{labels}}} 16000",
        f"sglang:kv_used_tokens{{{labels}}} {int(usage * 16000)}",
        f"sglang:page_size{{{labels}}} 16",
        f"sglang:num_queue_reqs{{{labels}}} {received}",
        f"sglang:num_decode_prealloc_queue_reqs{{{labels}}} {to_allocate}",
        f"sglang:num_decode_transfer_queue_reqs{{{labels}}} {receiving}", ""])


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
@pytest.mark.parametrize("to_allocate, receiving, received", [(0, 6, 3), (5, 0, 0), (4, 6, 3), (0, 0, 9)])
def test_a_decode_queue_of_transfers_is_never_room_nor_a_cap(engine, to_allocate, receiving, received):
    """Half full, 4 of many request slots running, every queued request a KV transfer: nothing caps the pool and
    no transfer says the pool has room, so the state is ok and nothing waits "with KV room"; the queue is the
    three stages' sum on both engines."""
    from kvcache_exporter import adapters
    from kvcache_exporter.sources import parser
    text = _decode_page(engine, 0.5, 4, to_allocate, receiving, received)
    adapter = adapters.ADAPTERS[engine]
    ranks, _ = derive.derive(adapter.adapt(parser.parse(text, adapter.wanted)), {}, 0.0, T, role="decode")
    gauges = ranks["0"].gauges
    assert gauges["requests_waiting"] == to_allocate + receiving + received
    assert gauges["requests_waiting_with_kv_room"] == 0 and gauges["requests_waiting_for_kv"] == 0
    assert ranks["0"].pressure == "ok"
    assert ranks["0"].labelled["kv_transfer_requests"] == {
        ("waiting_to_start",): to_allocate, ("in_progress",): receiving, ("completed_waiting",): received}


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_a_decode_pool_short_of_kv_waits_for_kv_only_with_its_transfers_to_allocate(engine):
    """At usage 0.95 the 5 transfers waiting for their KV to be allocated wait for KV (saturated); the 6
    receiving and the 3 received hold their KV already and wait for nothing the pool lacks."""
    from kvcache_exporter import adapters
    from kvcache_exporter.sources import parser
    adapter = adapters.ADAPTERS[engine]
    text = _decode_page(engine, 0.95, 4, 5, 6, 3)
    ranks, _ = derive.derive(adapter.adapt(parser.parse(text, adapter.wanted)), {}, 0.0, T, role="decode")
    gauges = ranks["0"].gauges
    assert (gauges["requests_waiting"], gauges["requests_waiting_for_kv"]) == (14, 5)
    assert gauges["requests_waiting_with_kv_room"] == 0 and gauges["kv_transfer_requests_waiting_for_kv"] == 5
    assert ranks["0"].pressure == "saturated"


@pytest.mark.parametrize("link, above", [
    (50e9, 3),  # the 50 GiB/s bound (53.7e9) is the smallest at or above 50e9: the 2 at 100 and the 1 at 400
    (100 * 2**30, 1),  # a bound itself: the 2 at exactly 100 GiB/s are not above it, the one at 400 is
    (150e9, 1),  # the 200 GiB/s bound: only the one above it
    (1e12, 0),  # above every finite bound: +Inf holds them all
])
def test_transfers_the_engine_timed_above_the_link_are_counted(link, above):
    """SGLang's speed histogram (GiB/s, read in bytes/s): 10 transfers, 4 at 8, 3 at 40, 2 at 100 and 1 at 400
    GiB/s. The exporter counts those above the link rate, to the precision of the engine's buckets."""
    gib = 2**30
    bounds = [b * gib for b in (10, 25, 50, 100, 200, 400)] + [float("inf")]
    histogram = Histogram(list(zip(bounds, (4, 4, 7, 9, 9, 10, 10))), (4 * 8 + 3 * 40 + 200 + 400) * gib, 10)
    values = RankValues(histograms={"kv_transfer_speed_bytes_per_second": histogram})
    thresholds = Thresholds(kv_transfer_link_bytes_per_second=link)
    assert derive.transfers_above_link(values, thresholds) == {"kv_transfer_above_link_total": above}
    assert derive.transfers_above_link(RankValues(), thresholds) == {}


# (usage, waiting, free tokens, live tokens per request, preempted since the last poll): the reason
@pytest.mark.parametrize("usage, waiting, free, live, preempted, expected", [
    (0.8, 2, 1000, 3000, False, "low_water"),  # 0.8 >= low water 0.75 decides first, though 1000 < 3000 holds too
    (0.5, 1, 999, 1000, False, "free_below_request"),  # under the mark, 999 free < 1000 per request
    (0.5, 2, 5000, 1000, True, "preempted"),  # under the mark with room, but a preemption since the last poll
    (0.5, 2, 5000, 1000, False, "cap"),
    (0.1, 2, None, None, False, "cap"),  # no running reading: the queue with KV room is read as a cap's
    (0.0, 2, 0, None, False, "admits_nothing"),  # the running reading (here the free slot) says none runs
    (0.93, 0, None, None, False, "high_water"),
    (0.3, 0, None, None, False, "room"),
])
def test_pressure_reason_names_the_rule_that_decided(usage, waiting, free, live, preempted, expected):
    gauges = {"usage_ratio": usage, "requests_waiting": waiting}
    if free is not None and live is not None:
        gauges |= {"free_tokens": free, "live_tokens_per_request": live}
    elif free is not None:  # nothing runs: no typical request
        gauges |= {"free_tokens": 5000, "requests_running": 0}
    assert derive.pressure_reason(gauges, 0.0, T, preempted) == expected
    assert derive.pressure_reason(gauges, 0.02, T, preempted) == "preemptions"  # at the thrashing rate


def test_headroom_is_zero_while_the_queue_waits_for_kv():
    """usage 0.8 of 8000 x 16 = 128000 tokens: 25600 free, 102400 / 32 = 3200 per request, 8 requests' worth; a
    queue at usage >= the low-water mark waits for KV all the same, so the contract's headroom is 0."""
    values = rank(usage_ratio=0.8, capacity_blocks=8000, block_size_tokens=16, requests_running=32,
                  requests_waiting=3, requests_waiting_for_capacity=3)
    ranks, _ = derive.derive(Snapshot("vllm", "m", "", {"0": values}), {}, 0.0, T)
    assert (ranks["0"].pressure, ranks["0"].reason, ranks["0"].gauges["headroom_requests"]) == (
        "saturated", "low_water", 0.0)
    assert ranks["0"].gauges["free_tokens"] == 25600  # the free KV itself is as it was


def finished(values: RankValues, requests: int, prompt_tokens: int) -> RankValues:
    """`values` with `requests` finished requests of `prompt_tokens` prompt tokens between them."""
    values.counters["prompt_tokens_total"] = float(prompt_tokens)
    values.histograms["e2e_request_latency_seconds"] = Histogram([(math.inf, float(requests))], 1.0, float(requests))
    return values


def test_a_vllm_prefill_pools_kv_beyond_its_running_prompts_is_held_for_export():
    """usage 0.5 of 1000 x 16 = 8000 used tokens; 3 running of a mean 1,000-token prompt (100 requests, 100,000
    prompt tokens): 5000 held for the decode side's pull, and the running requests hold 1000 each."""
    values = finished(rank(usage_ratio=0.5, capacity_blocks=1000, block_size_tokens=16, requests_running=3),
                      100, 100_000)
    ranks, _ = derive.derive(Snapshot("vllm", "m", "", {"0": values}, export_hold="finished"), {}, 0.0, T,
                             role="prefill")
    gauges = ranks["0"].gauges
    assert (gauges["kv_transfer_held_tokens"], gauges["live_tokens_per_request"]) == (5000, 1000)
    assert gauges["headroom_requests"] == 8  # 8000 free / 1000
    # Nothing running: every used token is held, whatever the mean (none needed).
    idle = rank(usage_ratio=0.5, capacity_blocks=1000, block_size_tokens=16, requests_running=0)
    assert derive.kv_gauges(idle, None, "finished")["kv_transfer_held_tokens"] == 8000
    # Running prompts larger than the used tokens: none held. Running without a finished request: unknown.
    crowded = finished(rank(usage_ratio=0.5, capacity_blocks=1000, block_size_tokens=16, requests_running=9), 1, 1000)
    assert derive.kv_gauges(crowded, None, "finished")["kv_transfer_held_tokens"] == 0
    assert "kv_transfer_held_tokens" not in derive.kv_gauges(
        rank(usage_ratio=0.5, capacity_blocks=1000, block_size_tokens=16, requests_running=3), None, "finished")
    # The same page on a decode or unified pool holds nothing for export: used / running as ever.
    for role in ("decode", "unified"):
        ranks, _ = derive.derive(Snapshot("vllm", "m", "", {"0": finished(
            rank(usage_ratio=0.5, capacity_blocks=1000, block_size_tokens=16, requests_running=4), 100, 100_000)},
            export_hold="finished"), {}, 0.0, T, role=role)
        assert "kv_transfer_held_tokens" not in ranks["0"].gauges
        assert ranks["0"].gauges["live_tokens_per_request"] == 2000


def test_an_sglang_prefill_pools_inflight_queue_holds_its_prompts_kv():
    """6 in the inflight queue of a mean 512-token prompt: 3072 held, no more than the 2000 used tokens where fewer
    are used (shared prefixes count once in the pool)."""
    def inflight(used: int, sending: int) -> RankValues:
        values = finished(rank(used_tokens=used, capacity_tokens=100_000, block_size_tokens=1, requests_running=2),
                          10, 5120)
        values.labelled["kv_transfer_requests"] = {("in_progress",): float(sending)}
        return values

    gauges = derive.kv_gauges(inflight(5072, 6), None, "inflight")
    assert (gauges["kv_transfer_held_tokens"], gauges["live_tokens_per_request"]) == (3072, 1000)
    assert derive.kv_gauges(inflight(2000, 6), None, "inflight")["kv_transfer_held_tokens"] == 2000
    assert derive.kv_gauges(inflight(2000, 0), None, "inflight")["kv_transfer_held_tokens"] == 0


def test_the_mean_prompt_is_the_windows_and_the_lifetime_one_only_where_none_finished_within_it():
    """A vLLM prefill pool polled every 15 s over the 60 s window, 3 running on 20,000 used tokens, its latency group
    turned off (the finished-request counter counts): 100 requests of 200 tokens, then 4,000-token prompts at 2 a
    poll, an engine restart (counters back to 2 requests of 4,000), 2 of 400 tokens, then nothing finishes."""
    def page(requests: float, prompt_tokens: float) -> Snapshot:
        values = rank(used_tokens=20_000, capacity_tokens=100_000, block_size_tokens=16, requests_running=3)
        values.counters.update(prompt_tokens_total=prompt_tokens, requests_finished_total=requests)
        return Snapshot("vllm", "m", "", {"0": values}, export_hold="finished")

    histories: dict = {}
    held = []
    polls = [(100, 20_000), (102, 28_000), (104, 36_000), (106, 44_000), (108, 52_000),
             (2, 8_000), (4, 8_800), (4, 8_800), (4, 8_800), (4, 8_800), (4, 8_800)]
    for t, (requests, prompt_tokens) in enumerate(polls):
        ranks, histories = derive.derive(page(requests, prompt_tokens), histories, t * 15.0, T, role="prefill")
        held.append(ranks["0"].gauges["kv_transfer_held_tokens"])
    # 20,000 - 3 x the mean prompt. The first poll: no window yet, the lifetime 200. To 75 s: 8,000 tokens a step
    # of 2 requests, 4,000 (the restart's drop adds nothing; the lifetime mean would read 52,000 / 108 = 481 at 60 s).
    # 90 s, from 30 s: (8,000 + 8,000 + 800) / 6 = 2,800; 105 s: 8,800 / 4 = 2,200; 120 and 135 s: 800 / 2 = 400.
    # 150 s: none finished since 90 s, the lifetime mean: 8,800 / 4 = 2,200.
    assert held == [19_400, 8_000, 8_000, 8_000, 8_000, 8_000, 11_600, 13_400, 18_800, 18_800, 13_400]
    # One point at or before the window's start kept as its base, as for the preemption rate.
    assert histories["0"].finished_requests == ((90.0, 4.0), (105.0, 4.0), (120.0, 4.0), (135.0, 4.0), (150.0, 4.0))
    assert [t for t, _ in histories["0"].prompt_tokens] == [90.0, 105.0, 120.0, 135.0, 150.0]
    # On a decode pool the two are not kept: no hold to estimate.
    _, decode = derive.derive(page(4, 8_800), {}, 0.0, T, role="decode")
    assert decode["0"] == derive.RankHistory()


def test_the_finished_requests_are_the_engines_counter_else_its_latency_count():
    """The counter where the adapter read one (vLLM's request_success_total, SGLang's num_requests_total), else the
    end-to-end latency histogram's count; neither: unknown."""
    both = finished(rank(), 7, 700)
    both.counters["requests_finished_total"] = 9.0
    assert derive.finished_requests(both) == 9
    assert derive.finished_requests(finished(rank(), 7, 700)) == 7
    assert derive.finished_requests(rank()) is None
