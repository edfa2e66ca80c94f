"""Adapters: detection and spellings, directly on the fixture pages."""

from __future__ import annotations

import re

import pytest

from devtools import harness
from kvcache_exporter import adapters
from kvcache_exporter.sources import parser

# Each test twice: with the adapters' compiled loops and with their pure-Python reference (conftest.py).
pytestmark = pytest.mark.usefixtures("fold")

FIXTURES = harness.FIXTURES


def adapt(text: str):
    adapter = adapters.detect(text)
    return adapter, adapter.adapt(parser.parse(text, adapter.wanted))


def _expected_engines() -> dict[str, str]:
    """Every fixture page and sequence page with the engine its expectations name."""
    import yaml

    pages = {p.name.removesuffix(".expected.yml"): yaml.safe_load(p.read_text())["engine"]
             for p in FIXTURES.glob("*.txt.expected.yml")}
    for sequence in (FIXTURES / "sequences").iterdir():
        engine = sequence.name.split("-")[0]
        pages.update({f"sequences/{sequence.name}/{p.name}": engine for p in sequence.glob("*.txt")})
    return pages


EXPECTED_ENGINES = _expected_engines()


@pytest.mark.parametrize("page", sorted(EXPECTED_ENGINES))
def test_detection(page):
    """No page is taken for another engine's, including pages that carry two engines' prefixes
    (Dynamo's own series next to the engine page it passes through)."""
    assert adapters.detect((FIXTURES / page).read_text()).engine == EXPECTED_ENGINES[page]


def test_detection_covers_every_engine():
    assert set(EXPECTED_ENGINES.values()) == set(adapters.ADAPTERS)


def test_an_engine_page_wins_over_dynamos_own_series_wherever_they_stand():
    text = (FIXTURES / "dynamo-1.6-vllm-worker.txt").read_text()
    blocks = text.split("# HELP ")
    engine_first = "# HELP ".join([blocks[0], *blocks[3:], *blocks[1:3]])
    assert engine_first.index("vllm:") < engine_first.index("dynamo_component_")
    assert adapters.detect(engine_first).engine == adapters.detect(text).engine == "vllm"


def test_vllms_page_with_lmcache_series_is_vllm_wherever_they_stand():
    text = (FIXTURES / "vllm-lmcache.txt").read_text()
    blocks = text.split("# HELP ")
    lmcache_first = "# HELP ".join([blocks[0], *[b for b in blocks[1:] if b.startswith("lmcache:")],
                                    *[b for b in blocks[1:] if not b.startswith("lmcache:")]])
    assert lmcache_first.index("lmcache:") < lmcache_first.index("vllm:")
    assert adapters.detect(lmcache_first).engine == adapters.detect(text).engine == "vllm"


def test_lmcache_series_read_alike_on_vllms_page_and_on_lmcaches_own():
    """One mapping for LMCache's series: its own page (the lmcache adapter) and vLLM's page (the vLLM adapter)."""
    text = (FIXTURES / "vllm-lmcache.txt").read_text()
    own_page = "".join("# HELP " + block for block in text.split("# HELP ")[1:] if block.startswith("lmcache:"))
    assert "vllm:" not in own_page
    lmcache_adapter, own = adapt(own_page)
    _, on_vllm = adapt(text)
    assert lmcache_adapter.engine == "lmcache"
    shared = {s.concept for s in lmcache_adapter.series}
    assert own.ranks["0"].counters == {k: v for k, v in on_vllm.ranks["0"].counters.items() if k in shared} != {}
    assert own.ranks["0"].labelled == {k: v for k, v in on_vllm.ranks["0"].labelled.items() if k in shared} != {}


def test_a_page_without_a_gpu_pool_has_no_pressure_state_and_no_pool_gauges():
    """LMCache's own page: no usage, queue or capacity, so no pressure state (not `ok` from missing inputs),
    no derived pool gauges and no queue split; the tier readings pass through."""
    from kvcache_exporter import derive
    from kvcache_exporter.thresholds import DEFAULT

    _, snapshot = adapt((FIXTURES / "lmcache-0.5.6.txt").read_text())
    ranks, histories = derive.derive(snapshot, {}, 100.0, DEFAULT)
    rank = ranks["0"]
    assert rank.pressure is None
    assert rank.gauges == {}
    assert rank.labelled["tier_used_bytes"] == {("cpu",): 5368709120, ("disk",): 21474836480, ("remote",): 0}
    assert histories == {"0": derive.NO_HISTORY}


def test_generic_request_histograms_are_not_tensorrt_llm():
    """The unprefixed TensorRT-LLM names are generic: without its hard-coded first label they are someone else's."""
    page = (FIXTURES / "trtllm-1.1-unprefixed.txt").read_text().replace('{engine_type="undefined",', '{')
    assert adapters.detect(page) is None


def test_tensorrt_llm_spellings_read_the_same():
    """The request families read alike unprefixed (1.1), `trtllm:` (Dynamo 0.7) and `trtllm_` (1.3)."""
    readings = [adapt((FIXTURES / page).read_text())[1].ranks["0"].histograms
                for page in ("trtllm-1.1-unprefixed.txt", "trtllm-dynamo-0.7.txt", "trtllm-1.3.txt")]
    assert len(readings[0]) == 4
    assert readings[0] == readings[1] == readings[2]


def test_no_engine_detected_on_other_pages():
    assert adapters.detect("# TYPE node_load1 gauge\nnode_load1 0.5\n") is None


@pytest.mark.parametrize("page, colon, underscore", [("vllm-v1.txt", "vllm:", "vllm_"),
                                                     ("sglang-0.5.txt", "sglang:", "sglang_")])
def test_re_exported_spelling_reads_the_same(page, colon, underscore):
    """Re-exporters (and prometheus_client's OpenMetrics escaping) write `vllm_` for `vllm:`."""
    text = (FIXTURES / page).read_text()
    _, original = adapt(text)
    _, renamed = adapt(text.replace(colon, underscore))
    assert renamed == original
    assert len(original.ranks["0"].gauges) >= 5 and len(original.ranks["0"].histograms) >= 3


def test_every_adapter_concept_is_a_contract_family_of_its_kind():
    from kvcache_exporter import contract

    for adapter in adapters.ADAPTERS.values():
        for series in adapter.series:
            family = contract.FAMILIES[series.concept]
            # A polled family of the series' kind; a labelled one with all its labels filled.
            assert (family.fed_by, family.type, len(family.labels)) == (
                "poll", series.kind, len(series.labels) + bool(series.label_from)), (adapter.engine, series.concept)


CRASHES = sorted((harness.REPO / "fuzz" / "crashes").glob("*.txt"))


@pytest.mark.parametrize("page", CRASHES, ids=lambda p: p.name)
def test_inputs_the_fuzzer_found_are_read_or_rejected_cleanly(page):
    """Each once crashed the page path; now it yields a snapshot with only finite values, or a ParseError."""
    from kvcache_exporter import derive

    text = page.read_text(encoding="utf-8", errors="replace")
    adapter = adapters.detect(text)
    try:
        snapshot = adapter.adapt(parser.parse(text, adapter.wanted))
    except parser.ParseError:
        return
    for rank in snapshot.ranks.values():
        values = [*rank.gauges.values(), *rank.counters.values(), *derive.kv_gauges(rank).values()]
        assert all(value == value and abs(value) != float("inf") for value in values), page.name


def test_the_fuzzers_findings_are_kept():
    assert len(CRASHES) >= 5


def test_the_fuzzer_instruments_the_package_it_reads():
    """Coverage guides libFuzzer only through instrumented modules: after the package became kvcache_exporter,
    include=["exporter"] matched nothing and the fuzzer ran blind (its corpus stayed at one input)."""
    source = (harness.REPO / "fuzz" / "fuzz_parser.py").read_text()
    (included,) = re.findall(r"instrument_imports\(include=\[([^\]]*)\]\)", source)
    assert [name.strip().strip("\"'") for name in included.split(",")] == [adapters.__name__.split(".")[0]]


def _cache_config_page(engines: int, info: str) -> str:
    """`cache_config_info` as vLLM's PrometheusStatLogger.log_metrics_info writes it: one series per
    engine index, every one with the frontend's (summed) CacheConfig labels."""
    lines = ["# TYPE vllm:kv_cache_usage_perc gauge"]
    lines += [f'vllm:kv_cache_usage_perc{{engine="{i}",model_name="m"}} 0.5' for i in range(engines)]
    lines.append("# TYPE vllm:cache_config_info gauge")
    lines += [f'vllm:cache_config_info{{block_size="16",engine="{i}",{info}}} 1.0' for i in range(engines)]
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("engines, info, blocks, tokens", [
    # DP=2 of 15360 blocks each: the frontend writes 15360 + 15360 = 30720 on both engines' series;
    # per engine 30720 / 2 = 15360, less the null block = 15359 (tokens are then derived: 15359 x 16)
    (2, 'num_gpu_blocks="30720"', 15359, None),
    # the same with #42206's per-engine kv_cache_size_tokens (not summed): 15360 x 16 = 245760 counts the
    # null block too, so 245760 - 245760 / 15360 = 245760 - 16 = 245744 (= 15359 x 16)
    (2, 'kv_cache_size_tokens="245760",num_gpu_blocks="30720"', 15359, 245744),
    # DP=1, the label values of a real single-engine page: 661 blocks x 16 = 10576 tokens; 660 usable, 10560
    (1, 'kv_cache_size_tokens="10576",num_gpu_blocks="661"', 660, 10560),
    # a hybrid model's group-aware size is no multiple of the block size: the null block takes its share,
    # 209523 / 2000 = 104.7615 tokens; 209523 - 104.7615 = 209418.2385, whole tokens 209418
    (1, 'kv_cache_size_tokens="209523",num_gpu_blocks="2000"', 1999, 209418),
    # DP=3 with an odd sum (engines of 1001, 1001 and 1000 blocks: 3002): the even split is a guess,
    # 3002 // 3 = 1000 blocks, 999 usable on every engine
    (3, 'num_gpu_blocks="3002"', 999, None),
])
def test_vllm_capacity_per_data_parallel_engine(engines, info, blocks, tokens):
    _, snapshot = adapt(_cache_config_page(engines, info))
    assert sorted(snapshot.ranks) == [str(i) for i in range(engines)]
    for rank in snapshot.ranks.values():
        assert rank.gauges["capacity_blocks"] == blocks
        assert rank.gauges.get("capacity_tokens") == tokens


@pytest.mark.parametrize("info, min_hit", [
    # no alignment on the page (vLLM before the labels, or a frontend that never resolves them): the block size
    ('num_gpu_blocks="1000"', 16),
    # a hybrid model (Mamba or sliding-window groups): vLLM grows the full-attention block to match their page,
    # 2096 tokens here, while block_size stays the smallest group's 16; hits land on the 2096
    ('effective_attention_block_size="2096",cache_hit_alignment_tokens="None",num_gpu_blocks="1000"', 2096),
    # with the alignment resolved (prefix_match_unit finer than the block, partial hits on): the alignment wins
    ('effective_attention_block_size="2096",cache_hit_alignment_tokens="64",num_gpu_blocks="1000"', 64),
])
def test_vllm_shortest_prefix_that_can_hit(info, min_hit):
    gauges = adapt(_cache_config_page(1, info))[1].ranks["0"].gauges
    assert gauges["block_size_tokens"] == 16
    assert gauges["prefix_cache_min_hit_tokens"] == min_hit


def test_tensorrt_llm_block_size_from_its_kv_cache_config_info():
    """Without the tokens-per-block gauge the block size comes from `trtllm_kv_cache_config_info{page_size}`."""
    text = "".join(line for line in (FIXTURES / "trtllm-1.3.txt").read_text().splitlines(keepends=True)
                   if "kv_cache_tokens_per_block" not in line)
    assert 'page_size="32"' in text
    gauges = adapt(text)[1].ranks["0"].gauges
    assert gauges["block_size_tokens"] == 32
    assert adapt(text.replace('page_size="32"', 'page_size="none"'))[1].ranks["0"].gauges.get("block_size_tokens") is None
