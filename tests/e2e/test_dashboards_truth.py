"""What on-call sees is what the engines did: both dashboards and the alert rules against ground truth.

A mixed fleet of simulated engines (vLLM, SGLang and TensorRT-LLM; kv-saturation, concurrency-cap,
prefix-collapse, steady; one SGLang target with two data-parallel ranks) runs TIME_SCALE times
faster than real time through the real exporter into Debian's Prometheus, which evaluates the
generated rules on the same compressed clock (`alerts.generate.compress`, as test_alerts_e2e).
Meanwhile the test samples every engine's own model state (`SimulatedEngine.state()`: the
scheduler's queue and why its head waits, the block pool, the counters and histograms), never
the exporter's output. Then every panel of both dashboards is evaluated the way Grafana would
(variables at All and at one target, $__rate_interval from the scrape interval) and checked
against that truth. On failure the PNGs of every row are written under the test's tmp dir.

Timing: the exporter polls, Prometheus scrapes and evaluates every INTERVAL_S; what Prometheus
shows at wall time t is the engine at t - LAG_S at most. Truth conditions are therefore judged
with that slack: a condition must have held LAG_S longer than an alert's `for:` to require the
alert, and an alert is forbidden only where the condition never held `for:` minus LAG_S.
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import math
import threading
import time
from dataclasses import dataclass, field

import pytest
import yaml

from kvcache_exporter.alerts import generate
from kvcache_exporter.dashboards import build, fleet, target
from devtools import lint_dashboards as lint, preview_dashboards as preview
from kvcache_exporter.adapters import ADAPTERS
from kvcache_exporter.contract import PRESSURE_STATES
from kvcache_exporter import units
from kvcache_exporter.thresholds import DEFAULT
from kvcache_exporter.simulator.server import start_engine
from devtools import harness

TIME_SCALE = 20
INTERVAL_S = 1.0  # exporter poll, Prometheus scrape, rule evaluation (wall seconds)
LAG_S = 3.0  # poll + scrape + evaluation + a rate window's edge, wall seconds
RUN_S = 46.0  # wall seconds: one kv-saturation cycle (850 simulated s) and the others' first cycles
SAMPLE_S = 0.25
# The deployment's own settings on top of the defaults: the hit-ratio baseline is taken 4 simulated
# minutes back and the drop alert waits 2 minutes, so that prefix-collapse (300 s shared, 300 s
# collapsed) shows a drop against a baseline within one run; queue-share and nearly-full wait
# 4 minutes, within the ~8 minutes the queueing scenarios queue. Every other value is the default.
OVERRIDES = {"prefix_hit_baseline_offset": "4m", "prefix_hit_drop_for": "2m", "queue_dominates_for": "4m",
             "nearly_full_for": "4m"}
THRESHOLDS = generate.compress(dataclasses.replace(DEFAULT, **OVERRIDES), TIME_SCALE)
WINDOW_S = THRESHOLDS.window_seconds

# name -> (flavor, scenario, dp, seed, engine overrides)
FLEET = {
    "vllm-sat": ("vllm-v1", "kv-saturation", 1, 1, {}),
    # Two ranks, each with half the pool and half the arrivals: each saturates as one whole engine does.
    "sglang-sat-dp2": ("sglang", "kv-saturation", 2, 2, {"num_blocks": 512}),
    "vllm-cap": ("vllm-v1", "concurrency-cap", 1, 3, {}),
    "sglang-cap": ("sglang", "concurrency-cap", 1, 4, {}),
    "vllm-prefix": ("vllm-v1", "prefix-collapse", 1, 5, {}),
    "vllm-steady": ("vllm-v1", "steady", 1, 6, {}),
    "sglang-steady": ("sglang", "steady", 1, 7, {}),
    # No preemption counter, gauges refreshed only when a request finishes, token counters per finished request.
    "trtllm-sat": ("trtllm", "kv-saturation", 1, 8, {}),
    # A small GPU pool behind a CPU offload tier: most prefix hits come back from the CPU.
    "vllm-offload": ("vllm-v1", "offload-tier", 1, 9, {}),
}
STEADY = {"vllm-steady", "sglang-steady"}
QUEUEING = {"vllm-sat", "sglang-sat-dp2", "vllm-cap", "sglang-cap", "trtllm-sat"}
KV_SATURATION = {"vllm-sat", "sglang-sat-dp2", "trtllm-sat"}


def engine_of(name: str) -> str:
    return FLEET[name][0].split("-")[0]


# Targets whose engine exports no preemption counter: the preemption alert has nothing to read there.
WITHOUT_PREEMPTIONS = {name for name in FLEET if "preemptions_total" in ADAPTERS[engine_of(name)].not_reported}
# Engines whose prompt and cached-token counters count a request when it finishes, not when it is admitted.
COUNTED_AT_FINISH = {"trtllm"}
STATE_CODE = {state: code for code, state in enumerate(PRESSURE_STATES)}


@dataclass(frozen=True)
class Rank:
    """One rank's state as its scheduler last reported it, and its cumulative counters."""

    waiting: int
    waiting_reason: str | None
    running: int
    used_blocks: int
    num_blocks: int
    block_size: int
    preemptions: int
    finished: int
    queried: int
    hits: int
    offload_hits: int  # prompt tokens served from the offload tier
    queue_sum: float
    ttft_sum: float
    ttft_buckets: tuple[tuple[float, int], ...]  # cumulative, ending with (inf, count)

    @property
    def usage(self) -> float:
        return self.used_blocks / self.num_blocks

    @property
    def headroom(self) -> float | None:
        """Free tokens / live tokens per running request, as the contract defines it."""
        if not self.running:
            return None
        used = self.used_blocks * self.block_size
        return (self.num_blocks * self.block_size - used) / (used / self.running)


@dataclass
class Truth:
    """Samples of every target's ranks: (wall time, ranks)."""

    samples: dict[str, list[tuple[float, tuple[Rank, ...]]]] = field(default_factory=dict)

    def record(self, name: str, now: float, engine) -> None:
        at_finish = engine_of(name) in COUNTED_AT_FINISH
        ranks = tuple(Rank(
            waiting=s.report.waiting, waiting_reason=s.report.waiting_reason, running=s.report.running,
            used_blocks=s.report.used_blocks, num_blocks=s.config.num_blocks, block_size=s.config.block_size,
            preemptions=s.counters.preemptions, finished=s.counters.finished_requests,
            queried=s.counters.finished_prompt_tokens if at_finish else s.counters.prefix_queried_tokens,
            hits=s.counters.finished_cached_tokens if at_finish else s.counters.prefix_hit_tokens,
            offload_hits=s.counters.offload_hit_tokens,
            queue_sum=s.histograms["queue"].sum, ttft_sum=s.histograms["ttft"].sum,
            ttft_buckets=tuple(s.histograms["ttft"].cumulative()),
        ) for s in engine.state().ranks)
        self.samples.setdefault(name, []).append((now, ranks))

    def at(self, name: str, t: float) -> tuple[Rank, ...]:
        """The last sample at or before `t` (the first one before the run)."""
        series = self.samples[name]
        index = bisect.bisect_right([s[0] for s in series], t) - 1
        return series[max(index, 0)][1]

    def between(self, name: str, start: float, end: float) -> list[tuple[Rank, ...]]:
        return [ranks for t, ranks in self.samples[name] if start <= t <= end]

    def delta(self, name: str, t: float, window: float, counter) -> float:
        """Increase of a per-rank counter summed over ranks over (t - window, t]."""
        return sum(counter(a) - counter(b) for a, b in zip(self.at(name, t), self.at(name, t - window)))


def held_runs(truth: Truth, name: str, condition) -> list[float]:
    """Lengths (wall seconds) of the stretches over which `condition(truth, name, t)` held at every sample."""
    runs, start = [], None
    times = [t for t, _ in truth.samples[name]]
    for t in times:
        if condition(truth, name, t):
            start = t if start is None else start
        elif start is not None:
            runs.append(t - start)
            start = None
    if start is not None:
        runs.append(times[-1] - start)
    return runs or [0.0]


# --- the alert conditions, applied to the engines' own state ------------------------------------

def queued_for_kv(truth, name, t):
    return any(r.waiting > 0 and r.waiting_reason == "kv" for r in truth.at(name, t))


def busy(truth, name, t):
    return truth.delta(name, t, WINDOW_S, lambda r: r.finished) / WINDOW_S >= THRESHOLDS.traffic_floor_requests_per_second


def preempting_above(rate):
    def condition(truth, name, t):
        if name in WITHOUT_PREEMPTIONS:
            return False  # the engine preempts but exports no count of it: nothing can fire
        return truth.delta(name, t, WINDOW_S, lambda r: r.preemptions) / WINDOW_S > rate and busy(truth, name, t)
    return condition


def queue_dominates(truth, name, t):
    queue = truth.delta(name, t, WINDOW_S, lambda r: r.queue_sum)
    ttft = truth.delta(name, t, WINDOW_S, lambda r: r.ttft_sum)
    return ttft > 0 and queue / ttft > THRESHOLDS.queue_share_of_ttft and busy(truth, name, t)


def hit_ratio(truth, name, t) -> float | None:
    queried = truth.delta(name, t, WINDOW_S, lambda r: r.queried)
    return truth.delta(name, t, WINDOW_S, lambda r: r.hits) / queried if queried else None


def hit_ratio_dropped(truth, name, t):
    baseline_age = units.parse_duration(THRESHOLDS.prefix_hit_baseline_offset)
    now, before = hit_ratio(truth, name, t), hit_ratio(truth, name, t - baseline_age)
    queried_rate = truth.delta(name, t, WINDOW_S, lambda r: r.queried) / WINDOW_S
    return (now is not None and before and t - baseline_age >= truth.samples[name][0][0]
            and now < THRESHOLDS.prefix_hit_drop_fraction * before
            and queried_rate >= THRESHOLDS.traffic_floor_prefix_tokens_per_second)


def nearly_full(truth, name, t):
    return max(r.usage for r in truth.at(name, t)) >= THRESHOLDS.high_water_ratio


def filling(truth, name, t):
    """The trend half of KVCacheNearlyFull can fire from the low-water mark on."""
    return max(r.usage for r in truth.at(name, t)) >= THRESHOLDS.low_water_ratio


# (alert name, severity) -> (condition that requires it, condition without which it must stay silent)
ALERT_TRUTH = {
    ("KVCacheShortageQueueing", "critical"): (queued_for_kv, queued_for_kv, THRESHOLDS.shortage_for),
    ("KVCacheNearlyFull", "warning"): (nearly_full, filling, THRESHOLDS.nearly_full_for),
    ("KVCachePreemptionStorm", "warning"): (preempting_above(THRESHOLDS.preemption_storm_warning_per_second),
                                            preempting_above(THRESHOLDS.preemption_storm_warning_per_second),
                                            THRESHOLDS.preemption_storm_for),
    ("KVCachePreemptionStorm", "critical"): (preempting_above(THRESHOLDS.preemption_storm_critical_per_second),
                                             preempting_above(THRESHOLDS.preemption_storm_critical_per_second),
                                             THRESHOLDS.preemption_storm_for),
    ("KVCachePrefixHitRateDrop", "warning"): (hit_ratio_dropped, hit_ratio_dropped, THRESHOLDS.prefix_hit_drop_for),
    ("KVCacheQueueDominatesTTFT", "warning"): (queue_dominates, queue_dominates, THRESHOLDS.queue_dominates_for),
}
# Every target answers and the exporter runs the whole time: these never fire.
NEVER = ("KVCacheTargetDown", "KVCacheExporterDown", "KVCacheExporterAbsent")


def expected_alerts(truth: Truth) -> tuple[set, set]:
    """(alerts that must fire, alerts that may fire), each a set of (alertname, severity, target)."""
    must, may = set(), set()
    for (alertname, severity), (requires, allows, for_) in ALERT_TRUTH.items():
        hold = units.parse_duration(for_)
        for name in FLEET:
            if max(held_runs(truth, name, requires)) >= hold + LAG_S:
                must.add((alertname, severity, name))
            if max(held_runs(truth, name, allows)) >= hold - LAG_S:
                may.add((alertname, severity, name))
    return must, may | must


# --- the stack ----------------------------------------------------------------------------------

@dataclass
class Run:
    prometheus_url: str
    truth: Truth
    start: float
    end: float
    models: dict[str, str]


def exporter_config(urls: dict[str, str]) -> dict:
    return {
        "poll_interval": f"{INTERVAL_S:g}s",
        "labels": {"cluster": "truth"},
        "pressure": dataclasses.asdict(THRESHOLDS),
        "targets": [{"name": name, "url": url, "engine": engine_of(name),
                     "labels": {"pool": FLEET[name][1]}} for name, url in urls.items()],
    }


def sample_until(truth: Truth, engines: dict, stop: threading.Event) -> None:
    while not stop.wait(SAMPLE_S):
        now = time.time()
        for name, engine in engines.items():
            truth.record(name, now, engine)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    work = tmp_path_factory.mktemp("dashboards-truth")
    rules = work / "kvcache-rules.yml"
    rules.write_text(generate.render(generate.build(THRESHOLDS)))
    engines = {name: start_engine(flavor, scenario, speed=TIME_SCALE, seed=seed, dp=dp, **overrides)
               for name, (flavor, scenario, dp, seed, overrides) in FLEET.items()}
    truth, stop = Truth(), threading.Event()
    try:
        config = work / "exporter.yml"
        config.write_text(yaml.safe_dump(exporter_config({name: e.url for name, e in engines.items()})))
        with harness.exporter(work, "--config", str(config)) as exporter:
            interval = f"{INTERVAL_S:g}s"
            prometheus_config = {
                "global": {"scrape_interval": interval, "scrape_timeout": interval, "evaluation_interval": interval},
                "rule_files": [str(rules)],
                "scrape_configs": [{"job_name": "kvcache-exporter",
                                    "static_configs": [{"targets": [exporter.url.removeprefix("http://")]}]}],
            }
            with harness.prometheus(work / "prometheus", prometheus_config) as prometheus:
                harness.wait_until(lambda: len(harness.prom_vector(prometheus.url, "kvcache_target_up == 1"))
                                   == len(FLEET), 30, what="Prometheus to scrape every target")
                sampler = threading.Thread(target=sample_until, args=(truth, engines, stop), daemon=True)
                start = time.time()
                sampler.start()
                time.sleep(RUN_S)
                end = time.time()
                time.sleep(LAG_S)  # what the engines did by `end` reaches Prometheus; the truth goes on
                stop.set()
                sampler.join()
                yield Run(prometheus.url, truth, start, end, {n: e.model_name for n, e in engines.items()})
    finally:
        stop.set()
        for engine in engines.values():
            engine.stop()


@pytest.fixture
def artifacts_on_failure(run, request, tmp_path):
    """Write the preview PNGs of both dashboards when the test fails, and print where."""
    failed_before = request.session.testsfailed
    yield
    # The call phase's report is logged before teardown, so a failure of this test is counted here.
    if request.session.testsfailed > failed_before:
        out = tmp_path / "dashboard-preview"
        preview.render_all(run.prometheus_url, out, clock(run).range_seconds, INTERVAL_S, end=clock(run).end)
        print(f"\ndashboard previews of the failed run: {out}")


# --- evaluating the dashboards ------------------------------------------------------------------

def clock(run: Run) -> preview.Clock:
    return preview.Clock(end=run.end + LAG_S, range_seconds=run.end + LAG_S - run.start, scrape_seconds=INTERVAL_S)


def evaluated(run: Run, name: str, chosen: dict[str, str]) -> dict[str, preview.PanelData]:
    dashboard = json.loads((build.GENERATED / name).read_text())
    prometheus = preview.Prometheus(run.prometheus_url)
    values = preview.variable_values(dashboard, prometheus, chosen, clock(run))
    return {p["title"]: preview.evaluate(p, prometheus, values, clock(run)) for p in lint.panels(dashboard)}


@pytest.fixture(scope="module")
def fleet_all(run):
    return evaluated(run, fleet.FILENAME, {})


def by_target(data: preview.PanelData, ref: str = "A") -> dict[str, list[tuple[float, float]]]:
    return {labels.get("target", ""): [(t, v) for t, v in points if not math.isnan(v)]
            for labels, points in data.series[ref]}


def last(points: list[tuple[float, float]]) -> float:
    return points[-1][1]


def shown_at(t: float) -> list[float]:
    """The truth sample times whose state Prometheus may show at `t`."""
    return [t - LAG_S + k * SAMPLE_S for k in range(int(LAG_S / SAMPLE_S) + 1)]


# --- the checks ---------------------------------------------------------------------------------

def test_the_run_did_what_the_scenarios_say(run):
    """The ground truth itself: otherwise the checks below would check nothing."""
    truth = run.truth
    reasons = {name: {r.waiting_reason for ranks in truth.between(name, run.start, run.end) for r in ranks
                      if r.waiting} for name in FLEET}
    assert KV_SATURATION <= {n for n, why in reasons.items() if "kv" in why}
    assert {"vllm-cap", "sglang-cap"} <= {n for n, why in reasons.items() if "cap" in why}
    assert "kv" not in reasons["vllm-cap"] | reasons["sglang-cap"] | reasons["vllm-steady"] | reasons["sglang-steady"]
    assert len(truth.at("sglang-sat-dp2", run.end)) == 2
    # TensorRT-LLM's engine preempts as the others do; it only has no counter to show it.
    assert truth.delta("trtllm-sat", run.end, run.end - run.start, lambda r: r.preemptions) > 0


@pytest.mark.usefixtures("artifacts_on_failure")
def test_every_ratio_is_within_0_and_1(run, fleet_all):
    # Hit ratio vs baseline is a ratio of ratios: above 1 when the cache does better than before.
    of_ratios = {"Hit ratio vs baseline"}
    for name, chosen in ((fleet.FILENAME, {}), (target.FILENAME, {"target": "sglang-sat-dp2"})):
        panels = fleet_all if name == fleet.FILENAME else evaluated(run, name, chosen)
        checked = 0
        for title, data in panels.items():
            if data.panel["fieldConfig"]["defaults"]["unit"] != "percentunit" or title in of_ratios:
                continue
            for ref, series in data.series.items():
                values = [v for _, points in series for _, v in points if not math.isnan(v)]
                assert all(0 <= v <= 1 for v in values), (name, title, ref, min(values), max(values))
                checked += bool(values)
        assert checked >= 5, name


@pytest.mark.usefixtures("artifacts_on_failure")
def test_queue_share_is_high_on_queueing_pools_and_low_on_steady_ones(run, fleet_all):
    share = by_target(fleet_all["Share of TTFT spent queueing"])
    for name in STEADY:
        assert max(v for _, v in share[name]) < THRESHOLDS.queue_share_of_ttft, name
    for name in QUEUEING:
        assert max(v for _, v in share[name]) > THRESHOLDS.queue_share_of_ttft, name


@pytest.mark.usefixtures("artifacts_on_failure")
def test_latency_quantiles_lie_in_the_bucket_the_engine_put_them_in(run, fleet_all):
    """A fleet panel's per-target p90 TTFT sits in the bucket holding the engine's own 90th percentile."""
    # Prometheus' rate window (t - rate interval, t] starts and ends on scrapes of polls, each up to
    # INTERVAL_S old: the engine increments it sees lie between engine times in these ranges.
    rate_interval = clock(run).rate_interval
    ends = [-k * SAMPLE_S for k in range(int((2 * INTERVAL_S + SAMPLE_S) / SAMPLE_S) + 1)]
    starts = [-rate_interval + INTERVAL_S - k * SAMPLE_S for k in range(int((3 * INTERVAL_S) / SAMPLE_S) + 1)]
    checked = 0
    for name, points in by_target(fleet_all["Time to first token p90"]).items():
        sampled_from = run.truth.samples[name][0][0]
        for t, value in points[::5]:
            if t + min(starts) < sampled_from:
                continue  # the window reaches back before the truth was sampled
            bounds = set()
            for end in ends:
                now = run.truth.at(name, t + end)
                for start in starts:
                    before = run.truth.at(name, t + start)
                    counts = [(bound, sum(a.ttft_buckets[i][1] - b.ttft_buckets[i][1] for a, b in zip(now, before)))
                              for i, (bound, _) in enumerate(now[0].ttft_buckets)]
                    total = counts[-1][1]
                    if total:
                        index = next(i for i, (_, c) in enumerate(counts) if c >= 0.9 * total)
                        bounds |= {counts[index - 1][0] if index else 0.0, counts[index][0]}
            if len(bounds) >= 2 and math.isfinite(max(bounds)):
                # One bucket of slack either side: the scrapes' exact moments are unknown, and a p90 near a
                # bucket bound moves across it with one request more or less in the window.
                layout = [0.0, *(bound for bound, _ in run.truth.at(name, t)[0].ttft_buckets)]
                low = layout[max(layout.index(min(bounds)) - 1, 0)]
                high = layout[min(layout.index(max(bounds)) + 1, len(layout) - 1)]
                assert low - 1e-9 <= value <= high + 1e-9, (name, t, value, sorted(bounds))
                checked += 1
    assert checked >= 20
    # The triage table's p90 of a target is that target's own line (one bucket layout each).
    table = fleet_all["Pools that need help now"]
    headers, rows, _ = preview.table_rows(table)
    column = headers.index("TTFT p90")
    lines = by_target(fleet_all["Time to first token p90"])
    for row in rows:
        if row[column + 1] is not None:
            assert row[column + 1] == pytest.approx(last(lines[row[0]]), rel=1e-6), row[0]


@pytest.mark.usefixtures("artifacts_on_failure")
def test_overview_shows_the_worst_pool(run, fleet_all):
    t = run.end + LAG_S
    usage = last(by_target(fleet_all["Fullest pool's KV usage"])[""])
    fullest = [max(r.usage for n in FLEET for r in run.truth.at(n, s)) for s in shown_at(t)]
    assert min(fullest) - 0.02 <= usage <= max(fullest) + 0.02, (usage, fullest)
    # Headroom below 1 on a target's least-free rank: between the certain and the possible count.
    without_room = last(by_target(fleet_all["Pools without room for one more request"])[""])

    def short(n, s):
        rooms = [r.headroom for r in run.truth.at(n, s) if r.headroom is not None]
        return bool(rooms) and min(rooms) < 1

    samples = shown_at(t)
    certain = sum(all(short(n, s) for s in samples) for n in FLEET)
    possible = sum(any(short(n, s) for s in samples) for n in FLEET)
    assert certain <= without_room <= possible
    # Lowest hit ratio and most preemptions are the extreme of the per-target lines, not a sum.
    hit = [last(points) for points in by_target(fleet_all["Prefix-cache hit ratio per target"]).values() if points]
    lowest = last(by_target(fleet_all["Lowest prefix-cache hit ratio"])[""])
    assert any(lowest == pytest.approx(ratio, abs=1e-9) for ratio in hit), (lowest, hit)
    most = last(by_target(fleet_all["Most preemptions per minute"])[""])
    per_target = by_target(fleet_all["Preemption rate per target"])
    assert most == pytest.approx(60 * max(last(p) for p in per_target.values() if p), rel=1e-6)


@pytest.mark.usefixtures("artifacts_on_failure")
def test_pressure_states_name_the_cause(run, fleet_all):
    """Where the engine's queue waited on one cause over all the LAG_S Prometheus may lag, the lane says it."""
    lanes = by_target(fleet_all["Pressure state over time"])
    checked = {"capped": 0, "kv": 0}
    for name in FLEET:
        for t, code in lanes[name]:
            window = run.truth.between(name, t - LAG_S, t)
            reasons = {r.waiting_reason if r.waiting else None for ranks in window for r in ranks}
            if len(window) < 4 or len(reasons) != 1:
                continue
            [reason] = reasons
            state = PRESSURE_STATES[int(code)]
            if reason == "kv" and len(run.truth.at(name, t)) == 1:
                assert state in ("saturated", "thrashing"), (name, t, state)
                checked["kv"] += 1
            elif reason == "cap":
                assert state == "capped", (name, t, state)
                checked["capped"] += 1
        if name in STEADY | {"vllm-cap", "sglang-cap"}:
            assert all(PRESSURE_STATES[int(code)] not in ("saturated", "thrashing") for _, code in lanes[name]), name
    assert checked["capped"] >= 10 and checked["kv"] >= 10, checked
    # The table lists every target once, worst state first, with the lane's current state.
    headers, rows, _ = preview.table_rows(fleet_all["Pools that need help now"])
    assert sorted(row[0] for row in rows) == sorted(FLEET)
    states = [row[1 + headers.index("State")] for row in rows]
    assert states == sorted(states, reverse=True)


@pytest.mark.usefixtures("artifacts_on_failure")
def test_target_dashboard_shows_only_the_selected_target(run):
    for name in ("sglang-sat-dp2", "vllm-steady"):
        panels = evaluated(run, target.FILENAME, {"target": name})
        for title, data in panels.items():
            for ref, series in data.series.items():
                assert {labels.get("target", name) for labels, _ in series} <= {name}, (title, ref)
        ranks = {labels.get("dp_rank") for labels, _ in panels["KV usage per rank"].series["A"]}
        assert len(ranks) == len(run.truth.at(name, run.end))
    dashboard = json.loads((build.GENERATED / target.FILENAME).read_text())
    [annotation] = dashboard["annotations"]["list"]
    expr = preview.substitute(annotation["target"]["expr"], {"target": "vllm-steady", "cluster": ".*", "pool": ".*"},
                              clock(run))
    firing = harness.prom_query(run.prometheus_url, f"max_over_time(({expr})[{int(RUN_S + 2 * LAG_S)}s:1s])")
    assert {item["metric"].get("target", "") for item in firing["result"]} <= {"vllm-steady", ""}


@pytest.mark.usefixtures("artifacts_on_failure")
def test_alerts_fire_where_the_engines_were_in_trouble_and_nowhere_else(run):
    seconds = int(run.end + LAG_S - run.start)
    result = harness.prom_query(run.prometheus_url, f'max_over_time(ALERTS{{alertstate="firing"}}[{seconds}s])',
                                time=run.end + LAG_S)["result"]
    fired = {(a["metric"]["alertname"], a["metric"]["severity"], a["metric"].get("target", "")) for a in result}
    must, may = expected_alerts(run.truth)
    assert must <= fired, f"missing: {sorted(must - fired)}"
    assert fired <= may, f"unexpected: {sorted(fired - may)}"
    assert not {a for a in fired if a[0] in NEVER}
    assert not {a for a in fired if a[2] in STEADY}, "an alert fired on a steady pool"
    # The scenarios' point, which the truth bands above must agree with.
    assert {("KVCacheShortageQueueing", "critical", n) for n in KV_SATURATION} <= fired
    assert not {a for a in fired if a[0] == "KVCachePreemptionStorm" and a[2] in WITHOUT_PREEMPTIONS}
    assert {("KVCacheQueueDominatesTTFT", "warning", n) for n in QUEUEING} <= fired
    assert ("KVCachePrefixHitRateDrop", "warning", "vllm-prefix") in fired
    assert not {a for a in fired if a[0] == "KVCacheShortageQueueing" and a[2] in ("vllm-cap", "sglang-cap")}


@pytest.mark.usefixtures("artifacts_on_failure")
def test_panels_without_inputs_are_absent_for_the_engine_and_say_why(run, fleet_all):
    """TensorRT-LLM has no preemption counter: no preemption line for its target (not a line at 0), and the
    panel's description names it; every panel with inputs has its line."""
    assert WITHOUT_PREEMPTIONS == {"trtllm-sat"}
    for title in ("Preemption rate per target", "Most preemptions per minute"):
        assert "TensorRT-LLM" in fleet_all[title].panel["description"], title
    preemptions = by_target(fleet_all["Preemption rate per target"])
    assert "trtllm-sat" not in preemptions and {"vllm-sat", "sglang-sat-dp2"} <= set(preemptions)
    for title in ("Time to first token p90", "Share of TTFT spent queueing", "Prefix-cache hit ratio per target",
                  "Pressure state over time"):
        lines = by_target(fleet_all[title])
        assert lines.get("trtllm-sat"), title
    states = {PRESSURE_STATES[int(code)] for _, code in by_target(fleet_all["Pressure state over time"])["trtllm-sat"]}
    assert "saturated" in states and "thrashing" not in states, states


@pytest.mark.usefixtures("artifacts_on_failure")
def test_hits_by_source_follow_the_engines_tier(run):
    """The offload target's prefix hits split by source as its model counted them: over the run the CPU tier
    served more than the GPU pool, and the panel's shares, each a share of the same looked-up tokens, say so;
    the GPU share is the prefix-cache hit ratio of the same target, and all sources together the sum."""
    truth, name = run.truth, "vllm-offload"
    span = run.end - run.start
    cpu, gpu = (truth.delta(name, run.end, span, lambda r: getattr(r, field)) for field in ("offload_hits", "hits"))
    assert cpu > gpu > 0, (cpu, gpu)
    panels = evaluated(run, target.FILENAME, {"target": name})
    shares = {labels.get("source"): dict(points) for labels, points in panels["Prefix hits by source"].series["A"]}
    [(_, combined_points)] = panels["Prefix hits by source"].series["B"]
    combined = dict(combined_points)
    [(_, gpu_points)] = panels["Prefix-cache hit ratio per rank"].series["A"]
    gpu_ratio = dict(gpu_points)
    both = [t for t in shares["cpu"] if t in shares["gpu"] and not math.isnan(shares["cpu"][t] + shares["gpu"][t])]
    assert len(both) >= 10
    assert sum(shares["cpu"][t] for t in both) > sum(shares["gpu"][t] for t in both)
    for t in both:
        assert shares["gpu"][t] == pytest.approx(gpu_ratio[t], abs=1e-9)
        assert shares["cpu"][t] + shares["gpu"][t] == pytest.approx(combined[t], abs=1e-9)
        assert 0 <= combined[t] <= 1
