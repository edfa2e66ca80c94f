"""The adapters' compiled loops (exporter/adapters/cfold.pyx) against their pure-Python reference
(base.reference_collapse and base.reference_fold_histogram): the same Snapshot (values compared by repr, so NaN
and -0.0 count), the same rendered bytes and the same errors, for every adapter on every fixture page, along every
fixture sequence with the unchanged-histogram memo, on every input the fuzzer kept, and on generated histograms and
gauges (TP copies, a missing +Inf bucket or sum, NaN, -0.0, infinities, kept-bound subsets, a bound that is no
number). `make test` installs the package with a C compiler present, so the compiled loops must be there: a missing
build fails here."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings, strategies as st

from devtools import harness
from kvcache_exporter import adapters, derive, exposition
from kvcache_exporter.adapters import base, cfold
from kvcache_exporter.contract import FAILURE_REASONS
from kvcache_exporter.runtime.target import PollOutcome
from kvcache_exporter.sources import parser
from kvcache_exporter.thresholds import DEFAULT

PAGES = sorted(harness.FIXTURES.glob("*.txt")) + sorted(harness.FIXTURES.glob("sequences/*/*.txt"))
SEQUENCES = sorted(path for path in (harness.FIXTURES / "sequences").iterdir() if path.is_dir())
CRASHES = sorted((harness.REPO / "fuzz" / "crashes").glob("*.txt"))
KEPT = {"default": adapters.DEFAULT_KEPT, "all": {}}
POLL_TIME = 1_700_000_000.0


class Reading:
    """One target's reading of pages after the fetch, as exporter.runtime.target.Target does it: its own adapter
    (and so its own caches), unchanged-histogram memo, rank histories and render cache."""

    def __init__(self, adapter: adapters.Adapter, kept: adapters.KeptBounds):
        self.adapter, self.kept = type(adapter)(), kept
        self.memo, self.histories, self.prefixes = {}, {}, exposition.Prefixes()

    def read(self, text: str, now: float):
        """What the poll hands on, comparable: the Snapshot's repr and the rendered bytes, or the error."""
        try:
            snapshot = self.adapter.adapt(parser.parse(text, self.adapter.wanted), self.kept, self.memo)
            ranks, self.histories = derive.derive(snapshot, self.histories, now, DEFAULT)
        except parser.ParseError as err:
            return "ParseError", str(err)
        outcome = PollOutcome(True, snapshot.engine, snapshot.model, snapshot.version, 0.01, now, ranks)
        rendered = exposition.render_target("t", {}, "http://127.0.0.1:1/", outcome,
                                            dict.fromkeys(FAILURE_REASONS, 0), self.prefixes)
        return repr(snapshot), rendered.status, rendered.series


def polls(adapter: adapters.Adapter, kept: adapters.KeptBounds, texts: list[str], reference: bool) -> list:
    """What one target reads from `texts`, poll after poll 5 s apart, with the compiled loops or the reference."""
    reading = Reading(adapter, kept)
    if reference:
        with harness.reference_fold():
            return [reading.read(text, POLL_TIME + 5 * i) for i, text in enumerate(texts)]
    return [reading.read(text, POLL_TIME + 5 * i) for i, text in enumerate(texts)]


def assert_alike(texts: list[str]) -> None:
    for adapter in adapters.ADAPTERS.values():
        for kept in KEPT.values():
            assert polls(adapter, kept, texts, reference=False) == polls(adapter, kept, texts, reference=True)


def test_the_compiled_fold_is_the_one_that_runs():
    assert base.ADAPTER == adapters.ADAPTER == "cython"
    assert base.collapse is cfold.collapse
    assert base.fold_histogram is cfold.fold_histogram


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(harness.FIXTURES)))
def test_every_fixture_page_adapts_and_renders_alike(page):
    """Every adapter, read twice (the second time the memo hands the histograms on), every bound or the default
    subset."""
    text = page.read_text()
    assert_alike([text, text])


def test_the_fixture_pages_hold_what_the_comparison_needs():
    """The comparison above is not vacuous: the fixtures' histograms come in TP copies, and their samples go through
    the compiled fold."""
    folded = []
    fold = base.fold_histogram
    base.fold_histogram = lambda parts, *rest: folded.append(parts) or fold(parts, *rest)
    try:
        for page in PAGES:
            text = page.read_text()
            adapter = adapters.detect(text)
            adapter.adapt(parser.parse(text, adapter.wanted))
    finally:
        base.fold_histogram = fold
    buckets = [sample for parts in folded for sample in parts[0]]
    assert len(buckets) > 1000
    assert any("tp_rank=" in sample.label_text for sample in buckets)


@pytest.mark.parametrize("sequence", SEQUENCES, ids=lambda p: p.name)
def test_every_fixture_sequence_adapts_and_renders_alike_poll_after_poll(sequence):
    """The memo and the histories carried from poll to poll, each page then the same page again."""
    texts = [page.read_text() for page in sorted(sequence.glob("*.txt"))]
    assert_alike([text for text in texts for _ in range(2)])


@pytest.mark.parametrize("page", CRASHES, ids=lambda p: p.name)
def test_the_fuzzers_inputs_adapt_and_render_alike(page):
    text = page.read_text(errors="replace")
    assert_alike([text, text])


# Generated histograms: vLLM's time to first token, summed over its `priority` label, its DP rank the `engine`
# label, every other label (tp_rank, pid) a copy.
VLLM = adapters.ADAPTERS["vllm"]
TTFT = next(series for series in VLLM.series if series.concept == "time_to_first_token_seconds")
USAGE = next(series for series in VLLM.series if series.concept == "usage_ratio")
LMCACHE_USED = next(series for series in VLLM.series if series.sum_over == ("worker_id",))
BOUNDS = ["0.1", "0.5", "1.0", "+Inf", "+Inf", "NaN", "-0.0", "0", "1e3", "-Inf"]
VALUES = [0.0, -0.0, 1.0, 2.5, 3.0, 1e308, math.nan, math.inf, -math.inf]
copies = st.sampled_from(['tp_rank="0"', 'tp_rank="1"', 'tp_rank="10"', 'tp_rank="x"', 'pid="7"',
                          'tp_rank="0",pid="7"', ''])
ranks = st.sampled_from(['engine="0"', 'engine="1"', ''])
slices = st.sampled_from(['priority="0"', 'priority="1"', ''])
values = st.sampled_from(VALUES)


def label_text(*parts: str) -> str:
    return ",".join(part for part in ('model_name="m"', *parts) if part)


histogram_sample = st.one_of(
    st.builds(lambda r, s, c, le, v: (0, label_text(r, s, c, f'le="{le}"'), v), ranks, slices, copies,
              st.sampled_from(BOUNDS), values),
    st.builds(lambda part, r, s, c, v: (part, label_text(r, s, c), v), st.sampled_from([1, 2]), ranks, slices, copies,
              values))


def folded(fold, parts: tuple, caches: tuple, kept):
    try:
        return repr(fold(parts, caches, VLLM._copy_of, TTFT, kept))
    except parser.ParseError as err:
        return "ParseError", str(err)


@settings(max_examples=1500, deadline=None, derandomize=True)
@given(st.lists(histogram_sample, max_size=40),
       st.one_of(st.none(), st.sets(st.sampled_from([0.1, 0.5, 1.0, 1000.0, 0.0]), max_size=3)),
       st.booleans())
def test_generated_histograms_fold_alike(samples, kept, bad_bound):
    """Cold caches, then warm (filled by the other implementation: they share an adapter's caches)."""
    kept = None if kept is None else frozenset((*kept, math.inf))
    if bad_bound:
        samples = [*samples, (0, label_text('le="abc"'), 1.0)]
    names = [TTFT.names[0] + suffix for suffix in base.HISTOGRAM_SUFFIXES]
    parts = tuple([parser.Sample(names[part], text, value) for part, text, value in samples if part == number]
                  for number in range(3))
    compiled_caches, reference_caches = ({}, {}, {}), ({}, {}, {})
    expected = folded(base.reference_fold_histogram, parts, reference_caches, kept)
    assert folded(cfold.fold_histogram, parts, compiled_caches, kept) == expected
    assert folded(cfold.fold_histogram, parts, reference_caches, kept) == expected
    assert folded(base.reference_fold_histogram, parts, compiled_caches, kept) == expected


def test_a_generated_histogram_folds_to_the_arithmetic():
    """One case worked by hand: two TP copies (rank 0's taken whole), two priorities summed, one copy without
    its +Inf bucket passed over, a NaN bucket kept as NaN."""
    page = [(0, label_text('priority="0"', 'tp_rank="1"', 'le="0.5"'), 9.0),
            (0, label_text('priority="0"', 'tp_rank="1"', 'le="+Inf"'), 9.0),
            (1, label_text('priority="0"', 'tp_rank="1"'), 9.0),
            (0, label_text('priority="0"', 'tp_rank="0"', 'le="0.5"'), 1.0),
            (0, label_text('priority="0"', 'tp_rank="0"', 'le="+Inf"'), 2.0),
            (1, label_text('priority="0"', 'tp_rank="0"'), 0.75),
            (0, label_text('priority="1"', 'tp_rank="0"', 'le="0.5"'), math.nan),
            (0, label_text('priority="1"', 'tp_rank="0"', 'le="+Inf"'), 4.0),
            (1, label_text('priority="1"', 'tp_rank="0"'), 1.25),
            (2, label_text('priority="1"', 'tp_rank="0"'), 4.0),
            (0, label_text('priority="1"', 'tp_rank="2"', 'le="0.5"'), 5.0),
            (1, label_text('priority="1"', 'tp_rank="2"'), 5.0)]
    names = [TTFT.names[0] + suffix for suffix in base.HISTOGRAM_SUFFIXES]
    parts = tuple([parser.Sample(names[part], text, value) for part, text, value in page if part == number]
                  for number in range(3))
    # priority 0: copy 0 (buckets 1, 2; sum 0.75; no count: the +Inf bucket's 2); priority 1: copy 0 (NaN, 4;
    # 1.25; count 4). Copy 2 of priority 1 lacks +Inf, copy 1 of priority 0 sorts after copy 0.
    expected = {"0": ([(0.5, math.nan), (math.inf, 6.0)], 2.0, 6.0)}
    for fold in (cfold.fold_histogram, base.reference_fold_histogram):
        assert repr(fold(parts, ({}, {}, {}), VLLM._copy_of, TTFT, None)) == repr(expected)


gauge_sample = st.builds(lambda r, s, c, v: (label_text(r, s, c), v), ranks,
                         st.sampled_from(['worker_id="0"', 'worker_id="1"', '']), copies, values)


@settings(max_examples=1500, deadline=None, derandomize=True)
@given(st.lists(gauge_sample, max_size=20), st.sampled_from([USAGE, LMCACHE_USED]))
def test_generated_gauges_collapse_alike(samples, series):
    """Max over the copies (NaN loses, -0.0 against 0.0 keeps the first), the sum over the breakdown slices."""
    found = [parser.Sample(series.names[0], text, value) for text, value in samples]
    compiled_cache, reference_cache = {}, {}
    expected = repr(base.reference_collapse(found, reference_cache, VLLM._slice_of, series))
    assert repr(cfold.collapse(found, compiled_cache, VLLM._slice_of, series)) == expected
    assert repr(cfold.collapse(found, reference_cache, VLLM._slice_of, series)) == expected
    assert repr(base.reference_collapse(found, compiled_cache, VLLM._slice_of, series)) == expected
