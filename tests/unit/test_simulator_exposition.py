"""The family and label shape of each simulated flavor, checked against the engine reference."""

from __future__ import annotations

import re
from collections import defaultdict

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvcache_exporter.simulator.exposition import (
    FLAVORS, SGLANG_BUCKETS, VLLM_REQUEST_LATENCY_BUCKETS, VLLM_TTFT_BUCKETS, EngineState,
)
from kvcache_exporter.simulator.scenarios import ScenarioRun, load_scenario

CREATED = 1_750_000_000.0
MODEL = "org/model-7b"


def simulate(flavor: str, until: float, dp: int = 1, scenario: str = "kv-saturation", seed: int = 0) -> ScenarioRun:
    run = ScenarioRun(load_scenario(scenario), FLAVORS[flavor].reporting, seed=seed, dp=dp)
    run.advance_to(until)
    return run


class Page:
    """One rendered scrape: raw text, plus samples by name and family types from prometheus_client's parser."""

    def __init__(self, flavor: str, run: ScenarioRun, tp: int = 1):
        state = EngineState(model_name=MODEL, tp=tp, created_unix=CREATED,
                            ranks=tuple(model.snapshot() for model in run.models))
        registry = CollectorRegistry()
        registry.register(FLAVORS[flavor].make_collector(lambda: state, 0))
        self.text = generate_latest(registry).decode()
        self.samples: dict[str, list] = defaultdict(list)
        self.types: dict[str, str] = {}
        for family in text_string_to_metric_families(self.text):
            self.types[family.name] = family.type
            for sample in family.samples:
                self.samples[sample.name].append(sample)

    def value(self, name: str, **labels) -> float:
        matches = [s.value for s in self.samples[name] if labels.items() <= s.labels.items()]
        assert len(matches) == 1, f"{name}{labels}: {len(matches)} samples"
        return matches[0]

    def label_keys(self, name: str) -> set[frozenset]:
        return {frozenset(s.labels) for s in self.samples[name]}


# -- vLLM ---------------------------------------------------------------------------------------

VLLM_COUNTERS = ("vllm:num_preemptions", "vllm:prompt_tokens", "vllm:generation_tokens", "vllm:request_success")
VLLM_HISTOGRAMS = ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds",
                   "vllm:request_queue_time_seconds", "vllm:iteration_tokens_total")


def test_vllm_v1_page_has_current_names_engine_labels_and_created():
    run = simulate("vllm-v1", 300)
    model = run.models[0]
    page = Page("vllm-v1", run)
    counters = (*VLLM_COUNTERS, "vllm:prefix_cache_queries", "vllm:prefix_cache_hits")
    histograms = (*VLLM_HISTOGRAMS, "vllm:inter_token_latency_seconds")
    for name in counters:
        assert page.types[name] == "counter"
    for name in histograms:
        assert page.types[name] == "histogram"
    for name in (*counters, *histograms):
        # Text 0.0.4 renders _created as a gauge family of its own, one sample per child.
        created = page.samples[name + "_created"]
        assert created and {s.value for s in created} == {CREATED}
    for name in ("vllm:gpu_cache_usage_perc", "vllm:gpu_prefix_cache_queries_total",
                 "vllm:time_per_output_token_seconds_count"):
        assert name not in page.samples

    base = {"engine", "model_name"}
    for name, samples in page.samples.items():
        if name.startswith("vllm:") and not name.startswith("vllm:cache_config_info"):
            extra = {"le", "reason", "finished_reason"}
            assert all(base <= set(s.labels) <= base | extra for s in samples), name
            assert {s.labels["model_name"] for s in samples} == {MODEL}

    report, counters_now = model.report, model.counters
    assert page.value("vllm:kv_cache_usage_perc") == report.used_blocks / 1024
    assert page.value("vllm:num_requests_waiting") == report.waiting > 0
    assert page.value("vllm:num_requests_waiting_by_reason", reason="capacity") == report.waiting
    assert page.value("vllm:num_requests_waiting_by_reason", reason="deferred") == 0
    # vLLM counts a preemption once the victim is scheduled again, so the counter lags.
    assert 0 < page.value("vllm:num_preemptions_total") == counters_now.preemptions_rescheduled
    assert counters_now.preemptions_rescheduled <= counters_now.preemptions
    assert page.value("vllm:prefix_cache_hits_total") == counters_now.prefix_hit_tokens > 0
    finished = page.value("vllm:request_success_total", finished_reason="stop")
    assert page.value("vllm:e2e_request_latency_seconds_count") == finished
    assert page.value("vllm:request_queue_time_seconds_count") == finished  # observed at finish

    info = page.samples["vllm:cache_config_info"]
    assert len(info) == 1 and info[0].value == 1
    assert "model_name" not in info[0].labels and info[0].labels["engine"] == "0"
    assert info[0].labels["num_gpu_blocks"] == "1025"  # the pool's 1024 blocks + the null block
    assert info[0].labels["block_size"] == "16" and info[0].labels["enable_prefix_caching"] == "True"


def test_vllm_histograms_use_vllms_buckets_in_single_process_order():
    page = Page("vllm-v1", simulate("vllm-v1", 300))
    for name, bounds in (("vllm:time_to_first_token_seconds", VLLM_TTFT_BUCKETS),
                         ("vllm:request_queue_time_seconds", VLLM_REQUEST_LATENCY_BUCKETS)):
        les = [s.labels["le"] for s in page.samples[name + "_bucket"]]
        assert les == [*map(str, map(float, bounds)), "+Inf"]
        assert page.samples[name + "_bucket"][-1].value == page.value(name + "_count")
        lines = [line.split("{")[0] for line in page.text.splitlines() if line.startswith(name + "_")]
        assert lines[-4:] == [name + "_bucket", name + "_count", name + "_sum", name + "_created"]


def test_vllm_v1_with_data_parallelism_labels_each_engine():
    run = simulate("vllm-v1", 60, dp=2, scenario="steady")
    page = Page("vllm-v1", run)
    engines = {s.labels["engine"] for s in page.samples["vllm:num_requests_running"]}
    assert engines == {"0", "1"}
    assert {s.labels["engine"] for s in page.samples["vllm:cache_config_info"]} == {"0", "1"}
    for index, model in enumerate(run.models):
        assert page.value("vllm:prompt_tokens_total", engine=str(index)) == model.counters.prompt_tokens > 0
    # vLLM's frontend writes the blocks of both engines into each engine's series: (1024 + 1 null) x 2
    assert [s.labels["num_gpu_blocks"] for s in page.samples["vllm:cache_config_info"]] == ["2050", "2050"]
    assert all("kv_cache_size_tokens" not in s.labels for s in page.samples["vllm:cache_config_info"])


def test_vllm_v1_kv_tokens_writes_the_first_engines_token_capacity_unsummed():
    page = Page("vllm-v1-kv-tokens", simulate("vllm-v1-kv-tokens", 60, dp=2, scenario="steady"))
    infos = page.samples["vllm:cache_config_info"]
    assert [s.labels["engine"] for s in infos] == ["0", "1"]
    for info in infos:
        assert info.labels["num_gpu_blocks"] == "2050"  # summed: (1024 + 1) x 2
        # one engine: 1025 blocks / (8192 max_model_len / 16 = 512 blocks per request) = 2.001953125 requests
        # of 8192 tokens: int(2.001953125 x 8192) = 16400 tokens (= 1025 x 16, null block included)
        assert info.labels["kv_cache_max_concurrency"] == "2.001953125"
        assert info.labels["kv_cache_size_tokens"] == "16400"


def test_vllm_v0_page_has_legacy_names_model_name_only_and_no_created():
    run = simulate("vllm-v0", 300)
    page = Page("vllm-v0", run)
    assert "_created" not in page.text
    for name in ("vllm:gpu_cache_usage_perc", "vllm:gpu_prefix_cache_queries_total",
                 "vllm:gpu_prefix_cache_hits_total", "vllm:time_per_output_token_seconds_count",
                 *(n + "_total" for n in VLLM_COUNTERS[:3])):
        assert page.samples[name], name
    for name in ("vllm:kv_cache_usage_perc", "vllm:prefix_cache_queries_total",
                 "vllm:inter_token_latency_seconds_count", "vllm:num_requests_waiting_by_reason"):
        assert name not in page.samples
    for name, samples in page.samples.items():
        if name.startswith("vllm:") and name != "vllm:cache_config_info":
            assert all("engine" not in s.labels and s.labels["model_name"] == MODEL for s in samples)
    ttft_les = [s.labels["le"] for s in page.samples["vllm:time_to_first_token_seconds_bucket"]]
    assert ttft_les[-2:] == ["10.0", "+Inf"]  # before vLLM #15202
    info = page.samples["vllm:cache_config_info"][0]
    assert "# TYPE vllm:cache_config_info gauge" in page.text  # an Info in V0, a gauge on the wire
    assert "engine" not in info.labels and info.labels["num_gpu_blocks"] == "1025"
    assert page.value("vllm:gpu_cache_usage_perc") == run.models[0].report.used_blocks / 1024


# -- SGLang -------------------------------------------------------------------------------------

SCHEDULER_GAUGES = ("sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:token_usage",
                    "sglang:num_used_tokens", "sglang:kv_used_tokens", "sglang:kv_available_tokens",
                    "sglang:kv_evictable_tokens", "sglang:max_total_num_tokens", "sglang:page_size",
                    "sglang:num_pages", "sglang:cache_hit_rate", "sglang:gen_throughput")
SCHEDULER_LABELS = frozenset({"engine_type", "model_name", "moe_ep_rank", "pp_rank", "tp_rank"})
TOKENIZER_LABELS = frozenset({"engine_type", "model_name"})


def test_sglang_page_repeats_scheduler_state_per_tp_rank_in_multiprocess_shape():
    run = simulate("sglang", 300)
    model = run.models[0]
    page = Page("sglang", run, tp=2)
    assert "_created" not in page.text
    helps = [line for line in page.text.splitlines() if line.startswith("# HELP")]
    assert helps and all(line.endswith(" Multiprocess metric") for line in helps)

    for name in SCHEDULER_GAUGES:
        samples = page.samples[name]
        assert page.label_keys(name) == {SCHEDULER_LABELS}, name
        assert sorted(s.labels["tp_rank"] for s in samples) == ["0", "1"]
        assert samples[0].value == samples[1].value, name  # repeated, never to be summed
    capacity = page.value("sglang:max_total_num_tokens", tp_rank="0")
    pages, page_size = page.value("sglang:num_pages", tp_rank="0"), page.value("sglang:page_size", tp_rank="0")
    assert capacity == 16384 == pages * page_size
    split = sum(page.value(f"sglang:kv_{kind}_tokens", tp_rank="0") for kind in ("used", "available", "evictable"))
    assert split == capacity
    assert page.value("sglang:token_usage", tp_rank="1") == round(model.report.used_blocks / 1024, 2)
    assert page.value("sglang:num_used_tokens", tp_rank="1") == model.report.used_blocks * 16
    assert all(s.value != s.value for s in page.samples["sglang:fwd_occupancy"])  # NaN

    pids = {s.labels["pid"] for s in page.samples["sglang:num_retracted_reqs"]}
    assert page.label_keys("sglang:num_retracted_reqs") == {SCHEDULER_LABELS | {"pid"}} and len(pids) == 2
    for rank in ("0", "1"):
        assert page.value("sglang:num_retracted_requests_total", tp_rank=rank) == model.counters.preemptions > 0
        assert page.value("sglang:queue_time_seconds_count", tp_rank=rank) == model.histograms["queue"].count

    streaming = TOKENIZER_LABELS | {"is_streaming"}
    assert page.label_keys("sglang:prompt_tokens_total") == {streaming}
    assert page.label_keys("sglang:time_to_first_token_seconds_count") == {streaming}
    assert page.label_keys("sglang:inter_token_latency_seconds_count") == {TOKENIZER_LABELS}
    assert page.label_keys("sglang:cached_tokens_total") == {TOKENIZER_LABELS | {"cache_source"}}
    assert page.value("sglang:prompt_tokens_total") == model.counters.finished_prompt_tokens
    assert page.value("sglang:cached_tokens_total", cache_source="device") == model.counters.finished_cached_tokens
    assert page.value("sglang:e2e_request_latency_seconds_count") == model.counters.finished_requests
    les = [s.labels["le"] for s in page.samples["sglang:time_to_first_token_seconds_bucket"]]
    assert les == [*map(str, map(float, SGLANG_BUCKETS.ttft)), "+Inf"]


def test_sglang_histograms_put_sum_before_buckets_and_count_last():
    page = Page("sglang", simulate("sglang", 300), tp=2)
    for name in ("sglang:queue_time_seconds", "sglang:e2e_request_latency_seconds"):
        children: dict[str, list[str]] = defaultdict(list)
        for line in page.text.splitlines():
            if line.startswith(name + "_"):
                labels = re.sub(r'le="[^"]*",?', "", line[line.index("{"):line.index("}")])
                children[labels].append(line.split("{")[0].removeprefix(name))
        assert children
        for suffixes in children.values():
            assert suffixes[0] == "_sum" and suffixes[-1] == "_count"
            assert set(suffixes[1:-1]) == {"_bucket"}


def test_sglang_child_order_changes_between_scrapes():
    run = simulate("sglang", 60, scenario="steady")
    state = EngineState(model_name=MODEL, tp=4, created_unix=CREATED, ranks=(run.models[0].snapshot(),))
    registry = CollectorRegistry()
    registry.register(FLAVORS["sglang"].make_collector(lambda: state, 0))
    orders = set()
    for _ in range(10):
        page = generate_latest(registry).decode()
        orders.add(tuple(re.findall(r'^sglang:num_running_reqs\{.*tp_rank="(\d)"', page, re.MULTILINE)))
    assert all(sorted(order) == ["0", "1", "2", "3"] for order in orders)
    assert len(orders) > 1


def test_sglang_families_appear_on_first_use():
    fresh = Page("sglang", simulate("sglang", 0))
    assert fresh.samples["sglang:num_running_reqs"] and fresh.samples["sglang:max_total_num_tokens"]
    for name in ("sglang:num_retracted_requests_total", "sglang:prompt_tokens_total",
                 "sglang:cached_tokens_total", "sglang:time_to_first_token_seconds_count",
                 "sglang:queue_time_seconds_count"):
        assert name not in fresh.samples

    serving = Page("sglang", simulate("sglang", 60))  # requests finish, nothing retracted yet
    assert serving.samples["sglang:prompt_tokens_total"] and serving.samples["sglang:cached_tokens_total"]
    assert "sglang:num_retracted_requests_total" not in serving.samples
    assert {s.value for s in serving.samples["sglang:num_retracted_reqs"]} == {0}


def test_sglang_with_data_parallelism_labels_ranks_and_sums_tokenizer_counters():
    run = simulate("sglang", 60, dp=2, scenario="steady")
    page = Page("sglang", run, tp=2)
    assert page.label_keys("sglang:num_running_reqs") == {SCHEDULER_LABELS | {"dp_rank"}}
    ranks = {(s.labels["dp_rank"], s.labels["tp_rank"]) for s in page.samples["sglang:num_running_reqs"]}
    assert ranks == {("0", "0"), ("0", "1"), ("1", "0"), ("1", "1")}
    assert page.label_keys("sglang:prompt_tokens_total") == {TOKENIZER_LABELS | {"is_streaming"}}
    total = sum(model.counters.finished_prompt_tokens for model in run.models)
    assert page.value("sglang:prompt_tokens_total") == total > 0


# -- TensorRT-LLM -------------------------------------------------------------------------------

TRTLLM_LABELS = frozenset({"engine_type", "model_name"})


def test_trtllm_page_has_the_trtllm_generation_in_multiprocess_shape():
    run = simulate("trtllm", 300)
    model = run.models[0]
    page = Page("trtllm", run)
    assert "_created" not in page.text
    for name in ("trtllm_kv_cache_utilization", "trtllm_kv_cache_max_blocks", "trtllm_kv_cache_used_blocks",
                 "trtllm_kv_cache_free_blocks", "trtllm_kv_cache_tokens_per_block", "trtllm_num_requests_running",
                 "trtllm_num_requests_waiting"):
        assert page.types[name] == "gauge" and page.label_keys(name) == {TRTLLM_LABELS | {"pid"}}, name
    for name in ("trtllm_prompt_tokens", "trtllm_prompt_cached_tokens", "trtllm_generation_tokens"):
        assert page.types[name] == "counter" and page.label_keys(name + "_total") == {TRTLLM_LABELS}, name
    assert not any("preempt" in name for name in page.samples)  # no preemption counter
    assert "trtllm_num_paused_requests" in page.samples  # a gauge of requests waiting to resume

    report, counters = model.report, model.counters
    assert page.value("trtllm_kv_cache_utilization") == report.used_blocks / 1024
    assert page.value("trtllm_kv_cache_used_blocks") + page.value("trtllm_kv_cache_free_blocks") == 1024
    assert page.value("trtllm_num_requests_waiting") == report.waiting > 0
    assert page.value("trtllm_prompt_cached_tokens_total") == counters.finished_cached_tokens > 0
    assert page.value("trtllm_prompt_tokens_total") == counters.finished_prompt_tokens
    finished = page.value("trtllm_request_success_total", finished_reason="stop")
    assert page.value("trtllm_e2e_request_latency_seconds_count") == finished == counters.finished_requests
    assert page.value("trtllm_request_queue_time_seconds_count") == finished  # observed at finish
    les = [s.labels["le"] for s in page.samples["trtllm_time_to_first_token_seconds_bucket"]]
    assert les == [*map(str, map(float, VLLM_TTFT_BUCKETS)), "+Inf"]


def test_trtllm_gauges_refresh_only_when_a_request_finishes():
    """The iteration-stats loop wakes at request completion: while nothing finishes the gauges keep the
    last completion's state even though the pool and the batch move on."""
    run = simulate("trtllm", 30, scenario="steady")
    model = run.models[0]
    stale = refreshed = 0
    now = 30.0
    for _ in range(2000):
        finished, report = model.counters.finished_requests, model.report
        now += 0.01
        run.advance_to(now)
        if model.counters.finished_requests == finished:
            assert model.report is report  # no completion, no refresh
            stale += (len(model.running), model.pool.used) != (report.running, report.used_blocks)
        else:
            refreshed += model.report is not report
    assert stale > 10 and refreshed > 10


@pytest.mark.parametrize("flavor", list(FLAVORS))
def test_every_flavor_renders_an_idle_engine(flavor):
    page = Page(flavor, simulate(flavor, 0))
    usage_name = {"vllm-v1": "vllm:kv_cache_usage_perc", "vllm-v1-kv-tokens": "vllm:kv_cache_usage_perc",
                  "vllm-v0": "vllm:gpu_cache_usage_perc",
                  "sglang": "sglang:token_usage", "trtllm": "trtllm_kv_cache_utilization"}[flavor]
    assert [s.value for s in page.samples[usage_name]] == [0.0]


@pytest.mark.parametrize("flavor", list(FLAVORS))
def test_the_adapter_reads_what_the_model_holds(flavor):
    """Each simulated page parses like prometheus_client's parser reads it (Page) and the exporter's adapter,
    detected from the page, reads the model's reported pool and queue."""
    from kvcache_exporter import adapters
    from kvcache_exporter.sources import parser

    run = simulate(flavor, 300)
    page = Page(flavor, run)
    adapter = adapters.detect(page.text)
    assert adapter.engine == flavor.split("-")[0]
    snapshot = adapter.adapt(parser.parse(page.text, adapter.wanted))
    report = run.models[0].report
    gauges = snapshot.ranks["0"].gauges
    assert (gauges["requests_running"], gauges["requests_waiting"]) == (report.running, report.waiting)
    assert gauges["usage_ratio"] == pytest.approx(report.used_blocks / 1024, abs=0.005)  # SGLang rounds to 0.01
    assert snapshot.model == MODEL


@pytest.mark.parametrize("flavor", ["vllm-v1", "sglang"])
def test_an_offload_tier_shows_in_the_engines_names_and_the_adapter_reads_the_models_counters(flavor):
    from kvcache_exporter import adapters, derive
    from kvcache_exporter.sources import parser

    run = simulate(flavor, 300, scenario="offload-tier")
    page = Page(flavor, run)
    model = run.models[0]
    snap, counters, config = model.snapshot(), model.counters, model.config
    adapter = adapters.detect(page.text)
    labelled = derive.tier_values(adapter.adapt(parser.parse(page.text, adapter.wanted)).ranks["0"].labelled)
    tier_tokens = config.offload_blocks * config.block_size
    assert labelled["tier_capacity_tokens"] == {("cpu",): 4096 * 16} == {("cpu",): tier_tokens}
    assert counters.offload_hit_tokens > 0 and counters.offload_loaded_blocks > 0
    cpu_hits = counters.offload_hit_tokens if flavor == "vllm-v1" else counters.finished_offload_cached_tokens
    assert labelled["cached_prompt_tokens_total"][("cpu",)] == cpu_hits
    if flavor == "vllm-v1":
        assert page.value("vllm:kv_offload_load_bytes_total") == counters.offload_loaded_blocks * 16 * 131072
        assert labelled["tier_transfer_bytes_total"] == {
            ("cpu", "load"): counters.offload_loaded_blocks * config.block_bytes,
            ("cpu", "store"): counters.offload_stored_blocks * config.block_bytes}
        assert labelled["tier_transfer_seconds_total"][("cpu", "load")] == pytest.approx(counters.offload_load_seconds)
        assert labelled["cached_prompt_tokens_total"][("gpu",)] == counters.prefix_hit_tokens
        # No chunk is pinned between steps: the tier's non-evictable share is 0.
        assert (labelled["tier_usage_ratio"], labelled["tier_used_tokens"]) == ({("cpu",): 0.0}, {("cpu",): 0.0})
    else:
        assert page.value("sglang:hicache_host_used_tokens", tp_rank="0") == snap.offload_used_blocks * 16
        assert labelled["tier_used_tokens"] == {("cpu",): snap.offload_used_blocks * 16}
        assert labelled["tier_usage_ratio"][("cpu",)] == pytest.approx(snap.offload_used_blocks / 4096)
        assert labelled["tier_transfer_tokens_total"] == {("cpu", "load"): counters.offload_loaded_blocks * 16,
                                                          ("cpu", "store"): counters.offload_stored_blocks * 16}
        assert labelled["tier_transfer_seconds_total"][("cpu", "store")] == pytest.approx(
            counters.offload_store_seconds)
        # Bytes: each TP rank moves its shard; the exporter adds the ranks up to the whole blocks' bytes.
        assert labelled["tier_transfer_bytes_total"] == {
            ("cpu", "load"): counters.offload_loaded_blocks * config.block_bytes,
            ("cpu", "store"): counters.offload_stored_blocks * config.block_bytes}


def test_a_full_tier_refusing_stores_shows_as_vllms_allocation_failures():
    """offload-tier-full at 300 s: the page counts the model's refused allocations under vLLM's name, the tier's
    usage is its pinned share, and the adapter reads both."""
    from kvcache_exporter import adapters, derive
    from kvcache_exporter.sources import parser

    run = simulate("vllm-v1", 300, scenario="offload-tier-full")
    page = Page("vllm-v1", run)
    snap = run.models[0].snapshot()
    failures, pinned = snap.counters.offload_store_failures, snap.offload_pinned_blocks
    assert failures > 0 and pinned > 0
    assert page.value("vllm:kv_offload_allocation_failure_total") == failures
    assert page.value("vllm:kv_offload_cpu_cache_usage_perc") == pinned / 256
    adapter = adapters.detect(page.text)
    labelled = derive.tier_values(adapter.adapt(parser.parse(page.text, adapter.wanted)).ranks["0"].labelled)
    assert labelled["tier_store_failures_total"] == {("cpu",): failures}
    assert labelled["tier_usage_ratio"] == {("cpu",): pinned / 256}
    assert labelled["tier_used_tokens"] == {("cpu",): pinned * 16}
