"""The simulator's disaggregated prefill/decode pair: the model's accounting per scenario, and its pages as the
exporter's adapters read them (HTTP in this process)."""

from __future__ import annotations

import time
import urllib.request

import pytest
from prometheus_client import generate_latest

from kvcache_exporter import adapters, contract, derive
from kvcache_exporter.simulator.exposition import FLAVORS
from kvcache_exporter.simulator.pd import (PDModel, ScenarioError, load_pd_scenario, parse_pd_scenario, side_registry,
                                           side_state, start_pd_pair)
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
    for replica in pd.decodes:
        assert replica.side.used == sum(t.decode_blocks for t in (*replica.receiving, *replica.received,
                                                                  *replica.running))
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
    in_flight = sum(t.request.prompt_len for t in (*pd.decodes[0].receiving, *pd.decodes[0].received))
    not_first = sum(t.request.prompt_len for t in pd.decodes[0].running if t.request.generated == 0)
    assert pd.decode.peer_tokens == pd.decode.counters.prompt_tokens - not_first - sum(
        t.request.prompt_len for t in pd.decodes[0].received)
    if engine == "vllm":
        assert pd.decode.peer_tokens_planned == pd.decode.counters.prompt_tokens + sum(
            t.request.prompt_len for t in pd.decodes[0].receiving)
        assert pd.decode.peer_tokens_planned - pd.decode.peer_tokens == in_flight + not_first
    seconds = link.latency_s * count + moved_bytes / link.bytes_per_s
    if engine == "vllm":
        assert timer.transfer_bytes.sum == moved_bytes
        assert timer.transfer_seconds.sum == pytest.approx(seconds, rel=1e-9)
    else:  # SGLang counts MiB and ms
        assert timer.transfer_bytes.sum == pytest.approx(moved_bytes / 2**20, rel=1e-9)
        assert timer.transfer_seconds.sum == pytest.approx(seconds * 1000, rel=1e-9)
    assert len(pd.decodes[0].waiting_to_start) == 0


def test_decode_short_holds_prefill_kv_in_vllm_and_the_handshake_in_sglang():
    for engine in PULL:
        pd = model("pd-decode-short", engine, 60)
        shortest = 1.0
        while pd.now < 400:
            pd.advance_to(pd.now + 0.5)
            assert_blocks_add_up(pd)
            if pd.now > 100:
                assert pd.decodes[0].waiting_to_start  # the decode pool never catches up
                shortest = min(shortest, pd.decode.used / pd.decode.config.num_blocks)
        assert shortest >= DEFAULT.low_water_ratio  # short of KV all along: the exporter's kv_is_short holds
        held = sum(t.prefill_blocks for t in pd.held.values())
        if engine == "vllm":  # computed, waiting to be pulled
            assert held == pd.prefill.used and held >= 50 * 16 and pd.stages()["prefill"] == {}
        else:  # not computed before the decode side pre-allocates: the bootstrap queue is the prefill side's
            bootstrap = pd.stages()["prefill"]["waiting_to_start"]
            assert pd.prefill.used < 2000 and bootstrap == len(pd.decodes[0].waiting_to_start)
        assert pd.prefill.lease_expiries == 0


def test_lease_expiry_frees_prefill_kv_and_counts_the_transfers_that_complete_later():
    pd = model("pd-lease-expiry", "vllm", 300)
    assert_blocks_add_up(pd)
    assert pd.prefill.lease_expiries > 100
    # Every expired request is still waiting for the decode side, or its transfer completed after the expiry.
    expired_waiting = sum(t.expired for t in (*pd.decodes[0].waiting_to_start, *pd.decodes[0].receiving))
    assert pd.prefill.notifications_after_expiry + expired_waiting == pd.prefill.lease_expiries
    assert pd.prefill.notifications_after_expiry > 0
    assert all(not t.expired for t in pd.held.values())
    assert len(pd.decodes[0].running) <= 2  # the decode side's cap


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


# Prompts of whole blocks (64 of 16 tokens) and a decode pool that runs short of KV (pd-decode-short's), on a link
# slow enough (0.34 s a transfer, 88 % busy at 2.6 a second) that SGLang's prefill side sends one prompt after another.
HELD = {"prefill": {"num_blocks": 32768, "max_num_seqs": 64, "max_num_batched_tokens": 8192},
        "decode": {"num_blocks": 1536, "max_num_seqs": 64}, "link": {"lease_s": 600, "bytes_per_s": 4e8},
        "phases": [{"name": "decode-short", "duration_s": 600, "arrival_rate": 2.6, "prompt_len": 1024,
                    "output_len": 400, "prefix_share": 0}]}


def derived_side(pd: PDModel, engine: str, role: str, histories: dict | None = None) -> derive.DerivedRank:
    """One side's page as the model's last tick shows it, read by the exporter's adapter and derived with its role;
    with the exporter's `histories` from the polls before (updated for the next), else as a first poll."""
    text = generate_latest(side_registry(engine, lambda: side_state(pd, role, "m", 0.0), 7)).decode()
    adapter = adapters.ADAPTERS[engine]
    ranks, kept = derive.derive(adapter.adapt(parser.parse(text, adapter.wanted)), histories or {}, pd.now, DEFAULT,
                                None, role)
    if histories is not None:
        histories.update(kept)
    return ranks["0"]


@pytest.mark.parametrize("engine", PULL)
def test_prefill_kv_held_for_export_is_the_models_held_blocks(engine):
    """kvcache_kv_transfer_held_tokens on the prefill side is the blocks the model holds for the decode side (vLLM:
    computed, not pulled; SGLang: being sent) x the block size, at every poll: with every prompt 1,024 tokens the
    running or in-flight requests' prompts are the mean exactly. The prefill side's live tokens per request are the
    running prompts' own; the decode side reports none held."""
    pd = PDModel(parse_pd_scenario(HELD, "held", "held"), PULL[engine], FLAVORS["vllm-v1" if engine == "vllm"
                                                                                  else "sglang"].reporting.buckets, 7)
    block = pd.prefill.config.block_size
    held_polls = running_polls = 0
    histories: dict = {}
    while pd.now < 300:
        pd.advance_to(pd.now + 0.5)
        prefill = derived_side(pd, engine, "prefill", histories)
        truth = pd.held_blocks() * block
        if "kv_transfer_held_tokens" not in prefill.gauges:  # nothing finished yet: no mean prompt to count by
            assert pd.prefill.counters.finished_requests == 0 and (pd.computing or pd.held)
            continue
        assert prefill.gauges["kv_transfer_held_tokens"] == truth, pd.now
        assert prefill.gauges["used_tokens"] == pd.prefill.used * block
        held_polls += truth > 0
        if pd.computing:
            running_polls += 1
            assert prefill.gauges["live_tokens_per_request"] == 1024
        assert "kv_transfer_held_tokens" not in derived_side(pd, engine, "decode").gauges
    # The decode pool short of KV made the vLLM prefill side hold prompts at most polls; SGLang's slow link some.
    assert held_polls >= (400 if engine == "vllm" else 100) and running_polls >= 10, (held_polls, running_polls)


def test_prefill_kv_held_for_export_is_exact_while_nothing_runs():
    """vLLM with prompts of many lengths (pd-decode-short), polled every 0.5 s with the exporter's histories: while
    the prefill side computes nothing its used tokens are all held for export; while it computes, each running
    prompt is taken at the window's mean, off by at most the longest prompt (4,000 tokens) and a block each."""
    pd = model("pd-decode-short", "vllm", 60)
    block = pd.prefill.config.block_size
    idle = 0
    histories: dict = {}
    while pd.now < 300:
        pd.advance_to(pd.now + 0.5)
        held = derived_side(pd, "vllm", "prefill", histories).gauges["kv_transfer_held_tokens"]
        truth = pd.held_blocks() * block
        if not pd.computing:
            idle += truth > 0
            assert held == truth
        else:
            assert abs(held - truth) <= len(pd.computing) * (4000 + block)
    assert idle >= 300


# HELD's pair with prompt lengths that shift every 150 s (repeated): 256 tokens, then 2,048 (the decode pool short of
# KV and the link 0.67 s a long prompt, 80 % busy at 1.2 a second: both sides hold long prompts), then 256 again.
SHORT, LONG = 256, 2048
SHIFTING = {**HELD, "phases": [
    {"name": "short", "duration_s": 150, "arrival_rate": 1.2, "prompt_len": SHORT, "output_len": 400,
     "prefix_share": 0},
    {"name": "long", "duration_s": 150, "arrival_rate": 1.2, "prompt_len": LONG, "output_len": 400,
     "prefix_share": 0}]}
POLL = 0.5
LATENCY_OFF = {name: frozenset() for name in contract.names(group="latency")}  # `families: {latency: false}`


@pytest.mark.parametrize("engine", PULL)
def test_prefill_kv_held_for_export_follows_a_shift_of_prompt_lengths_within_a_window(engine):
    """Prompts of 256 tokens, then 2,048, then 256 again, polled every 0.5 s with the exporter's histories: each
    request holding KV (vLLM: running; SGLang: in flight) is taken as one prompt of the mean over the window, so
    from one window and one poll after the last prompt of the old length finished on the prefill side the held
    tokens are the model's held blocks x 16 exactly (every prompt held then is of the new length, and so is every
    one counted over the window); before, off by at most the difference of the two lengths per request holding.
    The lifetime mean (no history: what the exporter read before) misses by hundreds of tokens a request there, in
    the direction of each engine's hold (vLLM's running prompts taken too short: held too high; SGLang's in-flight
    ones too short: held too low). With the latency group turned off the finished-request counter counts the
    requests: the same values."""
    pd = PDModel(parse_pd_scenario(SHIFTING, "shifting", "shifting"), PULL[engine],
                 FLAVORS["vllm-v1" if engine == "vllm" else "sglang"].reporting.buckets, 7)
    block, window = pd.prefill.config.block_size, DEFAULT.window_seconds
    adapter, hold = adapters.ADAPTERS[engine], "finished" if engine == "vllm" else "inflight"
    histories: dict = {}
    off_histories: dict = {}
    polls = []  # (time, held, truth, requests holding, lifetime held, finished prompts by length)
    while pd.now < 450:
        pd.advance_to(pd.now + POLL)
        text = generate_latest(side_registry(engine, lambda: side_state(pd, "prefill", "m", 0.0), 7)).decode()
        samples = parser.parse(text, adapter.wanted)
        snapshot = adapter.adapt(samples)
        ranks, histories = derive.derive(snapshot, histories, pd.now, DEFAULT, None, "prefill")
        off, off_histories = derive.derive(adapter.adapt(samples, LATENCY_OFF), off_histories, pd.now, DEFAULT,
                                           None, "prefill")
        assert "e2e_request_latency_seconds" not in off["0"].values.histograms
        gauges = ranks["0"].gauges
        assert off["0"].gauges.get("kv_transfer_held_tokens") == gauges.get("kv_transfer_held_tokens"), pd.now
        if "kv_transfer_held_tokens" not in gauges:  # nothing finished yet: no mean prompt to count by
            assert pd.prefill.counters.finished_requests == 0
            continue
        counters = pd.prefill.counters
        long_done = (counters.finished_prompt_tokens - SHORT * counters.finished_requests) // (LONG - SHORT)
        holding = len(pd.computing) if engine == "vllm" else len(pd.held)
        lifetime = derive.kv_gauges(snapshot.ranks["0"], None, hold)["kv_transfer_held_tokens"]
        polls.append((pd.now, gauges["kv_transfer_held_tokens"], pd.held_blocks() * block, holding, lifetime,
                      (counters.finished_requests - long_done, long_done)))
    exact = []  # per shift: from one window and one poll after the last prompt of the old length finished
    for shift, old in ((150, 0), (300, 1)):
        final = [finished[old] for t, *_, finished in polls if t < shift + 150][-1]
        drained = min(t for t, *_, finished in polls if t >= shift and finished[old] == final)
        exact.append((drained + window + POLL, shift + 150))
    exact_polls, lifetime_misses = [0, 0], []  # the latter on long prompts, per request holding
    for t, held, truth, holding, lifetime, _ in polls:
        if t < 150 or any(start <= t < end for start, end in exact):
            assert held == truth, t
            exact_polls[t >= 300] += t >= 150
            if exact[0][0] <= t < exact[0][1] and holding:
                lifetime_misses.append((lifetime - truth) / holding)
        else:
            assert abs(held - truth) <= holding * (LONG - SHORT), t
    assert min(exact_polls) >= 60, (exact_polls, exact)  # >= 30 s of each length read exactly after its shift
    # The lifetime mean, at most the simulator's prompt tokens over requests finished at the second shift, takes
    # each long prompt holding KV that much short of its 2,048 tokens: held too high (vLLM) or too low (SGLang).
    finished = [f for t, *_, f in polls if t < 300][-1]
    longest_mean = (SHORT * finished[0] + LONG * finished[1]) / sum(finished)
    assert LONG - longest_mean >= 500 and len(lifetime_misses) >= 10, (longest_mean, lifetime_misses)
    assert all(miss >= LONG - longest_mean if engine == "vllm" else miss <= longest_mean - LONG
               for miss in lifetime_misses), (longest_mean, lifetime_misses)
