"""The simulator's disaggregated prefill/decode pair: the model's accounting per scenario, and its pages as the
exporter's adapters read them (HTTP in this process)."""

from __future__ import annotations

import time
import urllib.request

import pytest

from kvcache_exporter import adapters, derive
from kvcache_exporter.simulator.exposition import FLAVORS
from kvcache_exporter.simulator.pd import PDModel, ScenarioError, load_pd_scenario, parse_pd_scenario, start_pd_pair
from kvcache_exporter.sources import parser
from kvcache_exporter.thresholds import DEFAULT

BYTES_PER_TOKEN = 131072
PULL = {"vllm": True, "sglang": False}


def model(scenario: str, engine: str, until: float, seed: int = 7) -> PDModel:
    pd = PDModel(load_pd_scenario(scenario), PULL[engine], FLAVORS["vllm-v1" if engine == "vllm" else "sglang"]
                 .reporting.buckets, seed)
    pd.advance_to(until)
    return pd


def assert_blocks_add_up(pd: PDModel) -> None:
    assert pd.prefill.used == sum(t.prefill_blocks for t in (*pd.computing, *pd.held.values()))
    assert pd.decode.used == sum(t.decode_blocks for t in (*pd.receiving, *pd.received, *pd.running))
    assert 0 <= pd.prefill.used <= pd.prefill.config.num_blocks and 0 <= pd.decode.used <= pd.decode.config.num_blocks


@pytest.mark.parametrize("engine", PULL)
def test_steady_moves_every_prompt_once_at_the_links_speed(engine):
    pd = model("pd-steady", engine, 300)
    assert_blocks_add_up(pd)
    timer = pd.decode if engine == "vllm" else pd.prefill  # vLLM's decode side times, SGLang's prefill side
    link = pd.scenario.link
    count = timer.transfer_seconds.count
    assert count > 700  # ~3 req/s
    assert timer.failed_transfers == pd.prefill.lease_expiries == pd.prefill.notifications_after_expiry == 0
    moved_bytes = pd.decode.counters.prompt_tokens * BYTES_PER_TOKEN  # counted as each transfer completes
    # vLLM counts a load's tokens when it plans it (p2p) and again once the request has run (external_kv_transfer)
    in_flight = sum(t.request.prompt_len for t in (*pd.receiving, *pd.received))
    not_first = sum(t.request.prompt_len for t in pd.running if t.request.generated == 0)
    assert pd.decode.peer_tokens == pd.decode.counters.prompt_tokens - not_first - sum(
        t.request.prompt_len for t in pd.received)
    if engine == "vllm":
        assert pd.decode.peer_tokens_planned == pd.decode.counters.prompt_tokens + sum(
            t.request.prompt_len for t in pd.receiving)
        assert pd.decode.peer_tokens_planned - pd.decode.peer_tokens == in_flight + not_first
    seconds = link.latency_s * count + moved_bytes / link.bytes_per_s
    if engine == "vllm":
        assert timer.transfer_bytes.sum == moved_bytes
        assert timer.transfer_seconds.sum == pytest.approx(seconds, rel=1e-9)
    else:  # SGLang counts MiB and ms
        assert timer.transfer_bytes.sum == pytest.approx(moved_bytes / 2**20, rel=1e-9)
        assert timer.transfer_seconds.sum == pytest.approx(seconds * 1000, rel=1e-9)
    assert len(pd.waiting_to_start) == 0


def test_decode_short_holds_prefill_kv_in_vllm_and_the_handshake_in_sglang():
    for engine in PULL:
        pd = model("pd-decode-short", engine, 60)
        shortest = 1.0
        while pd.now < 400:
            pd.advance_to(pd.now + 0.5)
            assert_blocks_add_up(pd)
            if pd.now > 100:
                assert pd.waiting_to_start  # the decode pool never catches up
                shortest = min(shortest, pd.decode.used / pd.decode.config.num_blocks)
        assert shortest >= DEFAULT.low_water_ratio  # short of KV all along: the exporter's kv_is_short holds
        held = sum(t.prefill_blocks for t in pd.held.values())
        if engine == "vllm":  # computed, waiting to be pulled
            assert held == pd.prefill.used and held >= 50 * 16 and pd.stages()["prefill"] == {}
        else:  # not computed before the decode side pre-allocates: the bootstrap queue is the prefill side's
            assert pd.prefill.used < 2000 and pd.stages()["prefill"]["waiting_to_start"] == len(pd.waiting_to_start)
        assert pd.prefill.lease_expiries == 0


def test_lease_expiry_frees_prefill_kv_and_counts_the_transfers_that_complete_later():
    pd = model("pd-lease-expiry", "vllm", 300)
    assert_blocks_add_up(pd)
    assert pd.prefill.lease_expiries > 100
    # Every expired request is still waiting for the decode side, or its transfer completed after the expiry.
    expired_waiting = sum(t.expired for t in (*pd.waiting_to_start, *pd.receiving))
    assert pd.prefill.notifications_after_expiry + expired_waiting == pd.prefill.lease_expiries
    assert pd.prefill.notifications_after_expiry > 0
    assert all(not t.expired for t in pd.held.values()) and len(pd.running) <= 2  # the decode side's cap


@pytest.mark.parametrize("engine", PULL)
def test_one_transfer_in_five_fails_on_the_timing_side(engine):
    pd = model("pd-transfer-failures", engine, 600)
    timer, other = (pd.decode, pd.prefill) if engine == "vllm" else (pd.prefill, pd.decode)
    failed, succeeded = timer.failed_transfers, timer.transfer_seconds.count
    assert 0.15 < failed / (failed + succeeded) < 0.25
    assert other.failed_transfers == 0 and pd.prefill.lease_expiries == 0
    assert_blocks_add_up(pd)


def test_bad_link_keys_name_the_key():
    with pytest.raises(ScenarioError, match=r"x: link.failure_ratio: must be >= 0 and <= 1, got 2"):
        parse_pd_scenario({"link": {"failure_ratio": 2}, "phases": [{"duration_s": 1}]}, "x", "x")
    with pytest.raises(ScenarioError, match=r"x: decode.num_blocks: must be an integer"):
        parse_pd_scenario({"decode": {"num_blocks": "many"}, "phases": [{"duration_s": 1}]}, "x", "x")
    with pytest.raises(ScenarioError, match="not a P/D scenario"):
        load_pd_scenario("steady")


def read(url: str, role: str | None):
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    adapter = adapters.detect(text)
    snapshot = adapter.adapt(parser.parse(text, adapter.wanted))
    ranks, _ = derive.derive(snapshot, {}, 0.0, DEFAULT, None, snapshot.role or role)
    return adapter.engine, snapshot.role, ranks["0"]


def test_the_pairs_pages_read_as_the_engines_series():
    """vLLM's pages name no role and carry the NIXL connector's series (the stages on the decode side only);
    SGLang's name their role and time transfers on the prefill side in ms and MiB."""
    with start_pd_pair("vllm", "pd-decode-short", speed=40, seed=7, model="m") as vllm, \
            start_pd_pair("sglang", "pd-decode-short", speed=40, seed=7, model="m") as sglang:
        time.sleep(4)  # ~160 simulated seconds: the decode pools are short
        pages = {(engine, role): read(url, role) for engine, pair in (("vllm", vllm), ("sglang", sglang))
                 for role, url in (("prefill", pair.prefill_url), ("decode", pair.decode_url))}
        timed = sglang.state("prefill")[1].transfer_seconds
    assert {key: (engine, role) for key, (engine, role, _) in pages.items()} == {
        ("vllm", "prefill"): ("vllm", None), ("vllm", "decode"): ("vllm", None),
        ("sglang", "prefill"): ("sglang", "prefill"), ("sglang", "decode"): ("sglang", "decode")}
    vllm_decode, sglang_decode = pages["vllm", "decode"][2], pages["sglang", "decode"][2]
    assert vllm_decode.labelled["kv_transfer_requests"][("waiting_to_start",)] > 10
    assert "kv_transfer_requests" not in pages["vllm", "prefill"][2].labelled
    assert vllm_decode.gauges["kv_transfer_requests_waiting_for_kv"] == \
        vllm_decode.labelled["kv_transfer_requests"][("waiting_to_start",)]
    assert vllm_decode.pressure == "saturated"  # vLLM's capacity reason counts them
    assert sglang_decode.gauges["kv_transfer_requests_waiting_for_kv"] > 10
    # SGLang's queue is its three P/D queues, less those that hold their KV: the pre-allocation queue, read as
    # waiting for KV while KV is short, as vLLM's capacity reason
    assert sglang_decode.gauges["requests_waiting_for_kv"] == \
        sglang_decode.labelled["kv_transfer_requests"][("waiting_to_start",)]
    assert sglang_decode.pressure == "saturated"
    seconds = pages["sglang", "prefill"][2].values.histograms["kv_transfer_seconds"]
    assert seconds.count > 0 and seconds.sum <= timed.sum / 1000  # polled before the state was read
    assert vllm_decode.values.histograms["kv_transfer_seconds"].count > 0
    assert vllm_decode.values.counters["kv_transfer_prompt_tokens_total"] > 0
