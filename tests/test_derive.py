"""Derivation rules on plain values: KV arithmetic, counter resets, the pressure state."""

from __future__ import annotations

import pytest

from exporter import derive
from exporter.snapshot import RankValues, Snapshot
from exporter.thresholds import Thresholds

T = Thresholds()


def rank(**gauges) -> RankValues:
    return RankValues(gauges={k: float(v) for k, v in gauges.items()})


def test_vllm_blocks_from_usage_and_capacity():
    gauges = derive.kv_gauges(rank(usage_ratio=0.25, capacity_blocks=8000, block_size_tokens=16, requests_running=10))
    assert gauges["used_blocks"] == 2000 and gauges["free_blocks"] == 6000
    assert gauges["capacity_tokens"] == 128000
    assert gauges["used_tokens"] == 32000 and gauges["free_tokens"] == 96000
    assert gauges["live_tokens_per_request"] == 3200


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
    # the running cap binds while KV has room: vLLM still says `capacity`, the state stays ok
    ({"usage_ratio": 0.4, "requests_waiting": 30, "requests_waiting_for_capacity": 30}, 0.0, "ok"),
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
    assert derive.rate(histories["0"]) == pytest.approx(9 / 25)
