"""`kvcache-exporter top`'s arithmetic and layout, in this process: the per-minute figures from a window of
polls, and the columns that fit a terminal's width for the recorded exporter page (tests/fixtures/top/).
tests/e2e/test_top.py runs the command."""

from __future__ import annotations

import math

import pytest

from devtools import harness
from kvcache_exporter import derive
from kvcache_exporter.thresholds import DEFAULT
from kvcache_exporter.top import rows as top_rows, source
from kvcache_exporter.top.rates import Rates, RateWindow, histogram_quantile
from kvcache_exporter.top.source import Frame, Pool

PAGES = [(harness.FIXTURES / "top" / f"exporter-{n}.txt").read_text() for n in (1, 2)]


def test_histogram_quantile_interpolates_like_promql():
    inf = math.inf
    assert histogram_quantile(0.9, [(1.0, 0.0), (2.0, 10.0), (inf, 10.0)]) == 1.0 + 1.0 * 9 / 10
    assert histogram_quantile(0.5, [(4.0, 10.0), (inf, 10.0)]) == 2.0  # first bucket: from 0 to its bound
    assert histogram_quantile(0.9, [(1.0, 5.0), (2.0, 5.0), (inf, 10.0)]) == 2.0  # in +Inf: the highest bound
    assert histogram_quantile(0.9, [(1.0, 0.0), (inf, 0.0)]) is None  # no observation
    assert histogram_quantile(0.9, [(1.0, 3.0)]) is None  # no +Inf bucket: not a histogram


def pool(at: float, preempted: float) -> Pool:
    return Pool("t", "vllm", "m", "0", "unified", at, counters={"preemptions_total": preempted})


def frame(*pools: Pool) -> Frame:
    return Frame(pools[0].at, {p.key: p for p in pools}, {"t": True})


def test_rates_use_the_last_minute_of_polls_and_count_nothing_for_a_restart():
    window = RateWindow()
    for at, preempted in ((0.0, 100.0), (30.0, 130.0), (30.0, 130.0), (100.0, 200.0)):
        window.add(frame(pool(at, preempted)))
    # the poll at 0 s is older than the minute before 100 s; the one at 30 s is the base: 70 in 70 s
    assert window.rates(pool(0, 0).key).preemptions_per_min == pytest.approx(60.0)
    window.add(frame(pool(130.0, 5.0)))  # restarted: the step 200 -> 5 counts nothing
    window.add(frame(pool(160.0, 35.0)))
    # base 100 s (the last poll at or before 160 - 60): steps +0 (restart) and +30, over 60 s
    assert window.rates(pool(0, 0).key).preemptions_per_min == pytest.approx(30.0)


def test_the_preemption_rate_is_the_one_the_pressure_state_reads():
    # Polls at 0, 5, 12 and 20 s with 0, 1, 4 and 10 preemptions, window 10 s: the base is the last poll at or
    # before 20 - 10 (5 s), so 9 preemptions in 15 s: 0.6/s, 36/min, the rate the state compares with its threshold.
    window, history = RateWindow(10.0), ()
    for at, preempted in ((0.0, 0.0), (5.0, 1.0), (12.0, 4.0), (20.0, 10.0)):
        window.add(frame(pool(at, preempted)))
        history = derive.extend_history(history, at, preempted, 10.0)
    rates = window.rates(pool(0, 0).key)
    assert (rates.preemptions_per_min, rates.seconds) == (pytest.approx(36.0), 15.0)
    assert derive.rate(history) * 60 == pytest.approx(36.0)
    assert RateWindow().window == DEFAULT.window_seconds == 60.0


def test_hit_counts_an_external_caches_hits_beside_the_engines_own():
    # vLLM's hits are its GPU pool's; its KV connector's (LMCache, CPU offload) are counted apart, over the tokens
    # the GPU pool lacked: 300 + 200 of 1000 looked up come from a cache. SGLang's hits already hold every source.
    window = RateWindow()
    for at, scale in ((0.0, 1.0), (10.0, 2.0)):
        counters = {"prefix_cache_queried_tokens_total": 1000 * scale, "prefix_cache_hit_tokens_total": 300 * scale,
                    "external_cache_hit_tokens_total": 200 * scale}
        window.add(frame(Pool("t", "vllm", "m", "0", "unified", at, counters=counters)))
    assert window.rates(pool(0, 0).key).prefix_hit_ratio == pytest.approx(0.5)


def test_a_pool_read_once_has_no_rates_yet():
    window = RateWindow()
    window.add(frame(pool(0.0, 1.0)))
    assert window.rates(pool(0, 0).key) == Rates()  # every figure None: shown as "-"


def recorded_rows() -> list[dict]:
    window = RateWindow()
    for text in PAGES:
        last = source.read_frame(text, 0.0)
        window.add(last)
    return top_rows.build_rows(last, window)


@pytest.mark.parametrize("width", [40, 60, 80, 100, 200])
def test_the_columns_fit_the_width_and_the_state_stays(width):
    layout = top_rows.fit(recorded_rows(), width, bar=True, window_seconds=60.0)
    names = [column.name for column, _ in layout]
    assert sum(w for _, w in layout) + len(layout) - 1 <= width
    assert {"target", "state", "usage"} <= set(names)
    everything = top_rows.fit(recorded_rows(), None, bar=True, window_seconds=60.0)
    if sum(w for _, w in everything) + len(everything) - 1 <= width:
        assert len(layout) == len(everything)


def test_json_rows_name_each_pools_top_holders_by_resident_blocks():
    labels = 'target="t",engine="vllm",model="m",dp_rank="0",role="unified"'
    page = "".join(f'kvcache_tenant_blocks_resident{{{labels},tenant="{tenant}"}} {blocks}\n'
                   for tenant, blocks in (("aa", 5), ("other", 40), ("bb", 90), ("cc", 1)))
    page += f'kvcache_adapter_blocks_resident{{{labels},adapter="base"}} 136\n'
    page += f'kvcache_usage_ratio{{{labels}}} 0.5\n'
    plain = 'kvcache_usage_ratio{target="u",engine="vllm",model="m",dp_rank="0",role="unified"} 0.5\n'
    rows = top_rows.build_rows(source.read_frame(page + plain, 0.0), RateWindow())
    assert rows[0]["top_holders"] == {"tenant": [["bb", 90.0], ["other", 40.0], ["aa", 5.0]],
                                      "adapter": [["base", 136.0]]}
    assert "top_holders" not in rows[1]  # no KV event stream: no key
