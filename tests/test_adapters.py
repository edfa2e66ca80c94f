"""Adapters: detection and spellings, directly on the fixture pages."""

from __future__ import annotations

from pathlib import Path

import pytest

from exporter import adapters, parser

FIXTURES = Path(__file__).parent / "fixtures"


def adapt(text: str):
    adapter = adapters.detect(text)
    return adapter, adapter.adapt(parser.parse(text, adapter.wanted))


@pytest.mark.parametrize("page, engine", [("vllm-v1.txt", "vllm"), ("vllm-v0.txt", "vllm"),
                                          ("sglang-0.5.txt", "sglang"), ("sglang-underscore.txt", "sglang")])
def test_detection(page, engine):
    assert adapters.detect((FIXTURES / page).read_text()).engine == engine


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


def test_every_adapter_concept_is_a_snapshot_concept_with_a_contract_family():
    from exporter import contract, snapshot

    kinds = {"gauge": snapshot.GAUGES, "counter": snapshot.COUNTERS, "histogram": snapshot.HISTOGRAMS}
    families = {**contract.RANK_GAUGES, **contract.COUNTERS, **contract.HISTOGRAMS}
    for adapter in adapters.ADAPTERS.values():
        for series in adapter.series:
            assert series.concept in kinds[series.kind], (adapter.engine, series.concept)
            assert series.concept in families, series.concept


CRASHES = sorted((Path(__file__).resolve().parents[1] / "fuzz" / "crashes").glob("*.txt"))


@pytest.mark.parametrize("page", CRASHES, ids=lambda p: p.name)
def test_inputs_the_fuzzer_found_are_read_or_rejected_cleanly(page):
    """Each once crashed the page path; now it yields a snapshot with only finite values, or a ParseError."""
    from exporter import derive

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
