"""What on-call sees is what the engines did: both dashboards and the alert rules against ground truth.

A mixed fleet of simulated engines (vLLM, SGLang and TensorRT-LLM; kv-saturation, concurrency-cap,
prefix-collapse, steady, wedged; one SGLang target with two data-parallel ranks) runs TIME_SCALE times
faster than real time through the real exporter into Debian's Prometheus, which evaluates the
generated rules on the same compressed clock (`alerts.generate.compress`, as test_alerts_e2e).
Meanwhile the test samples every engine's own model state (`SimulatedEngine.state()`: the
scheduler's queue and why its head waits, the block pool, the counters and histograms), never
the exporter's output. Then both dashboards are drawn by Grafana 12.4's own code over the run
(devtools/grafana-render/: variables at All and at one target), every panel's answers to the very
queries Grafana sent are checked against that truth, and so is what Grafana displays: the fullest
pool's stat, the triage table's order, state words and colours, "No data" where an engine gives no
value. On failure both dashboards are drawn into the test's tmp dir and the path printed.

Timing: the exporter polls, Prometheus scrapes and evaluates every INTERVAL_S; what Prometheus
shows at wall time t is the engine at t - LAG_S at most (with the machine's cores free). The
state conditions of the alerts (a queue waiting for KV, a full pool) are judged with that slack:
a condition must have held LAG_S longer than an alert's `for:` to require the alert, and an
alert is forbidden only where the condition never held `for:` minus LAG_S.

Rates and latest values are judged on the very polls Prometheus holds instead: every scrape carries
the poll it came from (`kvcache_target_last_success_timestamp_seconds`, less its duration), and
every engine keeps the states its pages showed with the instant each was read (`served_history`),
so each value Prometheus holds is set against the state its poll read. A rate over a window of
three scrapes depends on which polls the window holds: when the test process is short of CPU the
simulated engines advance in bursts, and a fixed window on the truth's clock then sees a rate that
Prometheus' window, a poll or two off, never saw; a pool's headroom moves between two samples of
the truth (issue #28: a missed preemption storm, pools counted short that were not, or not short).
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import itertools
import json
import math
import re
import threading
import time
from dataclasses import dataclass, field

import pytest
import yaml

from kvcache_exporter.alerts import generate
from kvcache_exporter.dashboards import bands, build, fleet, target
from kvcache_exporter.dashboards.panels import LEGEND_ROWS
from kvcache_exporter.dashboards.signals import pressure
from devtools import grafana_render
from kvcache_exporter.adapters import ADAPTERS
from kvcache_exporter.contract import KV_SHORT_STATES, PRESSURE_REASONS, PRESSURE_STATES
from kvcache_exporter import contract, units
from kvcache_exporter.thresholds import DEFAULT
from kvcache_exporter.simulator.model import KV_BOUND
from kvcache_exporter.simulator.server import start_engine
from devtools import harness

TIME_SCALE = 20
INTERVAL_S = 1.0  # exporter poll, Prometheus scrape, rule evaluation (wall seconds)
LAG_S = 3.0  # poll + scrape + evaluation + a rate window's edge, wall seconds
TIMEOUT_S = 0.8 * INTERVAL_S  # the exporter's poll timeout
STALENESS_S = 3 * INTERVAL_S  # the exporter shows no value older than this
RUN_S = 46.0  # wall seconds: one kv-saturation cycle (850 simulated s) and the others' first cycles
SAMPLE_S = 0.25
SERVED_HISTORY = 1000  # pages each engine keeps the state of: every poll of the run
# The deployment's own settings on top of the defaults: the hit-ratio baseline is taken 4 simulated
# minutes back and the drop alert waits 2 minutes, so that prefix-collapse (300 s shared, 300 s
# collapsed) shows a drop against a baseline within one run; queue-share and nearly-full wait
# 4 minutes, within the ~8 minutes the queueing scenarios queue. Every other value is the default.
OVERRIDES = {"prefix_hit_baseline_offset": "4m", "prefix_hit_drop_for": "2m", "queue_dominates_for": "4m",
             "nearly_full_for": "4m"}
THRESHOLDS = generate.compress(dataclasses.replace(DEFAULT, **OVERRIDES), TIME_SCALE)
WINDOW_S = THRESHOLDS.window_seconds
# `scrape_duration_seconds` ends before the scrape's samples are committed (Prometheus 2.42's scrapeAndReport
# reports the duration in a deferred call that runs before the commit's), and a rule evaluated in between
# does not see them: the commit (a WAL write) may take this long with the second core busy.
COMMIT_S = 0.25

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
    # Serves as steady, then from 240 simulated seconds (12 s of wall time) admits and generates nothing for good.
    "vllm-wedged": ("vllm-v1", "wedged", 1, 10, {}),
}
# Configured at a loopback port nothing listens on: a target the exporter cannot poll.
DOWN = "vllm-down"
STEADY = {"vllm-steady", "sglang-steady"}
QUEUEING = {"vllm-sat", "sglang-sat-dp2", "vllm-cap", "sglang-cap", "trtllm-sat"}
KV_SATURATION = {"vllm-sat", "sglang-sat-dp2", "trtllm-sat"}


def engine_of(name: str) -> str:
    return FLEET[name][0].split("-")[0]


# Targets whose engine exports no preemption counter: the preemption alert has nothing to read there.
WITHOUT_PREEMPTIONS = {name for name in FLEET if "preemptions_total" in ADAPTERS[engine_of(name)].not_reported}
# Engines whose prompt and cached-token counters count a request when it finishes, not when it is admitted
# (SGLang's are the tokenizer's).
COUNTED_AT_FINISH = {"trtllm", "sglang"}
# vLLM counts a preemption when the preempted request is scheduled again, the others when it happens.
COUNTED_AT_RESCHEDULE = {"vllm"}
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
    prompted: int  # prompt tokens and generated tokens, as the engine's page counts them
    generated: int
    queue_sum: float
    ttft_sum: float
    ttft_buckets: tuple[tuple[float, int], ...]  # cumulative, ending with (inf, count)

    @property
    def usage(self) -> float:
        return self.used_blocks / self.num_blocks

    @property
    def headroom(self) -> float | None:
        """Free tokens / live tokens per running request: the contract's headroom while the pool is neither
        saturated nor thrashing (0 then: surely_without_room, maybe_without_room)."""
        if not self.running:
            return None
        used = self.used_blocks * self.block_size
        return (self.num_blocks * self.block_size - used) / (used / self.running)

    @property
    def shows_room(self) -> bool:
        """Whether the page shows KV room for a queue by the contract's rule (usage below the low-water mark and
        at least one typical live request's worth free), give or take a block (the engines' usage
        denominators differ by one). The page does not say what the queue's head needs: a long prompt, or an
        engine's reserve for the running requests' output to come, holds it back for KV beside that room."""
        if not self.running or self.used_blocks <= 1:
            return bool(self.running)
        lighter = dataclasses.replace(self, used_blocks=self.used_blocks - 1)
        return lighter.usage < THRESHOLDS.low_water_ratio and lighter.headroom >= 1


@dataclass(frozen=True)
class Poll:
    """One poll of a target by the exporter: the page it read was rendered between `start` and `end`."""

    start: float
    end: float  # the poll's last success timestamp


def ranks_of(name: str, state) -> tuple[Rank, ...]:
    """An engine state (`simulator.exposition.EngineState`) as the truth keeps it."""
    at_finish = engine_of(name) in COUNTED_AT_FINISH
    at_reschedule = engine_of(name) in COUNTED_AT_RESCHEDULE
    return tuple(Rank(
        waiting=s.report.waiting, waiting_reason=s.report.waiting_reason, running=s.report.running,
        used_blocks=s.report.used_blocks, num_blocks=s.config.num_blocks, block_size=s.config.block_size,
        preemptions=s.counters.preemptions_rescheduled if at_reschedule else s.counters.preemptions,
        finished=s.counters.finished_requests,
        queried=s.counters.finished_prompt_tokens if at_finish else s.counters.prefix_queried_tokens,
        hits=s.counters.finished_cached_tokens if at_finish else s.counters.prefix_hit_tokens,
        offload_hits=s.counters.offload_hit_tokens,
        prompted=s.counters.finished_prompt_tokens if at_finish else s.counters.prompt_tokens,
        generated=s.counters.finished_generation_tokens if at_finish else s.counters.generation_tokens,
        queue_sum=s.histograms["queue"].sum, ttft_sum=s.histograms["ttft"].sum,
        ttft_buckets=tuple(s.histograms["ttft"].cumulative()),
    ) for s in state.ranks)


@dataclass
class Truth:
    """Samples of every target's ranks: (wall time, ranks); and the states its pages showed, the same way."""

    samples: dict[str, list[tuple[float, tuple[Rank, ...]]]] = field(default_factory=dict)
    stamps: dict[str, list[float]] = field(default_factory=dict)  # the samples' times, for bisect
    served: dict[str, list[tuple[float, tuple[Rank, ...]]]] = field(default_factory=dict)

    def record(self, name: str, engine) -> None:
        state = engine.state()
        now = time.time()
        self.samples.setdefault(name, []).append((now, ranks_of(name, state)))
        self.stamps.setdefault(name, []).append(now)

    def record_served(self, name: str, engine) -> None:
        self.served[name] = [(read, ranks_of(name, state)) for read, state in engine.served()]

    def at(self, name: str, t: float) -> tuple[Rank, ...]:
        """The last sample at or before `t` (the first one before the run)."""
        index = bisect.bisect_right(self.stamps[name], t) - 1
        return self.samples[name][max(index, 0)][1]

    def polled(self, name: str, poll: Poll) -> list[tuple[Rank, ...]] | None:
        """The states the engine's pages showed while the poll ran, oldest first: the one it read, and another
        where a poll that had given up was answered late inside it. None where no page was rendered then."""
        return [ranks for read, ranks in self.served[name] if poll.start <= read <= poll.end] or None

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
    """A queue KV holds back: at the last step's admission ("kv"), or then, before a finish freed room ("freed")."""
    return any(r.waiting > 0 and r.waiting_reason in KV_BOUND for r in truth.at(name, t))


def nearly_full(truth, name, t):
    return max(r.usage for r in truth.at(name, t)) >= THRESHOLDS.high_water_ratio


def filling(truth, name, t):
    """The trend half of KVCacheNearlyFull can fire from the low-water mark on."""
    return max(r.usage for r in truth.at(name, t)) >= THRESHOLDS.low_water_ratio


def stalled(truth, name, t):
    """A rank with a queue beside KV below the low-water mark that processed no prompt and generated no token over
    the window before `t`."""
    return any(r.waiting > 0 and r.usage < THRESHOLDS.low_water_ratio
               and (r.prompted, r.generated) == (before.prompted, before.generated)
               for r, before in zip(truth.at(name, t), truth.at(name, t - WINDOW_S)))


def never(truth, name, t):
    return False


# (alert name, severity) -> (condition that requires it, condition without which it must stay silent, for).
# The shortage pages only where its queue also grows or its first tokens come late, which the engines' state at
# one instant does not tell: the page may fire only where the warning may; kv-saturation must page (below).
STATE_ALERTS = {
    ("KVCacheShortageQueueing", "warning"): (queued_for_kv, queued_for_kv, THRESHOLDS.shortage_for),
    ("KVCacheShortageQueueing", "critical"): (never, queued_for_kv, THRESHOLDS.shortage_for),
    ("KVCacheNearlyFull", "warning"): (nearly_full, filling, THRESHOLDS.nearly_full_for),
    ("KVCacheAdmissionStalled", "critical"): (stalled, stalled, THRESHOLDS.admission_stalled_for),
}
# The exporter runs the whole time: these never fire (KVCacheTargetDown fires on DOWN only).
NEVER = ("KVCacheExporterDown", "KVCacheExporterAbsent", "KVCacheExporterWorkerFailing")


# --- the rate alerts, on the polls Prometheus holds ---------------------------------------------

# The counters the rate alerts read, each as the engine's own state counts it.
RULE_COUNTERS = {
    "kvcache_preemptions_total": lambda r: r.preemptions,
    "kvcache_e2e_request_latency_seconds_count": lambda r: r.finished,
    "kvcache_prefix_cache_queried_tokens_total": lambda r: r.queried,
    "kvcache_prefix_cache_hit_tokens_total": lambda r: r.hits,
    "kvcache_queue_time_seconds_sum": lambda r: r.queue_sum,
    "kvcache_time_to_first_token_seconds_sum": lambda r: r.ttft_sum,
}
Bounds = tuple[float, float]  # what a rule's value was at least and at most


@dataclass
class Seen:
    """What Prometheus holds: for each scrape of each target the poll whose values it carried, every sample of
    the counters the rules read, and the instants at which the rules were evaluated."""

    polls: dict[str, dict[float, Poll]]  # target -> scrape time -> poll
    counters: dict[str, dict[str, dict[str, list[tuple[float, float]]]]]  # family -> target -> dp_rank -> samples
    evaluations: list[float]
    # scrape time (a sample's timestamp) -> when its scrape had read and appended the page: its samples are
    # visible to queries once committed, up to COMMIT_S later
    stored_at: dict[float, float]

    def scrapes(self, family: str, name: str) -> list[float]:
        """When Prometheus got a sample of `family` for the target: where the exporter showed it."""
        return sorted({scraped for samples in self.counters[family].get(name, {}).values() for scraped, _ in samples})


def seen_by(prometheus_url: str, since: float, until: float) -> Seen:
    seconds = math.ceil(until - since)

    def stored(name: str) -> list[tuple[dict, list[tuple[float, float]]]]:
        """Every sample of every series of `name` stored over the run, as scraped or evaluated."""
        result = harness.prom_query(prometheus_url, f'{name}{{cluster="truth"}}[{seconds}s]', time=until)["result"]
        return [(item["metric"], [(float(t), float(v)) for t, v in item["values"]]) for item in result]

    up = {labels["target"]: dict(values) for labels, values in stored("kvcache_target_up")}
    durations = {labels["target"]: dict(values) for labels, values in stored("kvcache_target_scrape_duration_seconds")}
    polls = {}
    for labels, values in stored("kvcache_target_last_success_timestamp_seconds"):
        name = labels["target"]
        # A scrape after a failed poll carries the last good one, whose duration it no longer shows: a poll
        # takes less than an interval (its fetch at most TIMEOUT_S).
        polls[name] = {t: Poll(end - (durations[name][t] if up[name].get(t) == 1 else INTERVAL_S), end)
                       for t, end in values}
    counters = {family: {} for family in RULE_COUNTERS}
    for family in RULE_COUNTERS:
        for labels, values in stored(family):
            counters[family].setdefault(labels["target"], {})[labels["dp_rank"]] = values
    evaluations = sorted({t for _, values in stored("kvcache:usage_ratio:max") for t, _ in values})
    durations = harness.prom_query(prometheus_url, f'scrape_duration_seconds{{job="kvcache-exporter"}}[{seconds}s]',
                                   time=until)["result"]
    stored_at = {float(t): float(t) + float(d) for item in durations for t, d in item["values"]}
    return Seen(polls, counters, evaluations, stored_at)


def engine_count(ranks: tuple[Rank, ...], dp_rank: str, per_rank: bool, value) -> float:
    """The engine's count behind one exported series: its rank's, or the sum over ranks where the engine
    counts once for all of them (SGLang's tokenizer)."""
    return value(ranks[int(dp_rank)]) if per_rank else sum(value(r) for r in ranks)


def prometheus_rate(first: tuple[float, float], last: tuple[float, float], count: int, end: float) -> float:
    """rate() over [end - WINDOW_S, end] as Prometheus 2 works it out (extrapolatedRate in promql/functions.go)
    from the first and last of `count` samples of a counter that did not reset."""
    (t1, v1), (tn, vn) = first, last
    increase = vn - v1
    if increase <= 0:
        return 0.0
    sampled = tn - t1
    step = sampled / (count - 1)
    to_start = min(t1 - (end - WINDOW_S), sampled * v1 / increase)  # never before the counter's zero
    span = sampled + sum(gap if gap < 1.1 * step else step / 2 for gap in (to_start, end - tn))
    return increase * span / sampled / WINDOW_S


def seen_rate(truth: Truth, seen: Seen, name: str, family: str, t: float, offset: float = 0.0) -> Bounds | None:
    """`sum without (dp_rank) (rate(family[WINDOW_S] offset ...))` evaluated at `t`, as Prometheus would have it
    had every poll shown the engine's own counter: the scrapes its window holds, each valued at the engine's
    count in the state its poll read. The rule ran at `t` or later and saw the scrapes stored by then: certainly
    those stored by `t`, perhaps the last ones too, which were still running at `t` (the machine busy, a scrape
    takes a while). None where the rule has no value; -inf as the least where it may have had none."""
    series = seen.counters[family].get(name, {})
    per_rank = set(series) != {"0"}
    end = t - offset
    scrapes = [scraped for scraped in seen.scrapes(family, name) if end - WINDOW_S <= scraped <= end]
    # Scrapes are stored in order.
    stored = sum(seen.stored_at.get(scraped, math.inf) + COMMIT_S <= t for scraped in scrapes)
    outcomes = [_rate_of_scrapes(truth, seen, name, family, series, per_rank, set(scrapes[:count]), end)
                for count in range(stored, len(scrapes) + 1)]
    rates = [rate for rate in outcomes if rate is not None]
    if not rates:
        return None
    least = min(low for low, _ in rates) if len(rates) == len(outcomes) else -math.inf
    return least, max(high for _, high in rates)


def window_held(seen: Seen, name: str, family: str, t: float) -> list[tuple]:
    """For a failure's message: each scrape of the rule's window at `t` (seconds before `t`), when it was read
    and appended (seconds after `t`: a scrape whose samples a rule at `t` may not have seen) and its samples."""
    series = seen.counters[family].get(name, {})
    return [(round(t - scraped, 3), round(seen.stored_at.get(scraped, math.inf) - t, 3),
             {rank: dict(samples).get(scraped) for rank, samples in series.items()})
            for scraped in seen.scrapes(family, name) if t - WINDOW_S <= scraped <= t]


def _rate_of_scrapes(truth, seen, name, family, series, per_rank, visible, end) -> Bounds | None:
    """The rule's value over the samples of these scrapes; (0, inf) where no page was rendered during a poll."""
    total, found = [0.0, 0.0], False
    for dp_rank, samples in series.items():
        inside = [scraped for scraped, _ in samples if scraped in visible]
        if len(inside) < 2:
            continue
        found = True
        first, last = (truth.polled(name, seen.polls[name][scraped]) for scraped in (inside[0], inside[-1]))
        if first is None or last is None:
            return 0.0, math.inf
        counts = [[engine_count(ranks, dp_rank, per_rank, RULE_COUNTERS[family]) for ranks in read]
                  for read in (first, last)]
        total[0] += prometheus_rate((inside[0], counts[0][-1]), (inside[-1], counts[1][0]), len(inside), end)
        total[1] += prometheus_rate((inside[0], counts[0][0]), (inside[-1], counts[1][-1]), len(inside), end)
    return (total[0], total[1]) if found else None


def quotient(numerator: Bounds | None, divisor: Bounds | None) -> Bounds | None:
    """numerator / (divisor > 0), as the rules divide rates; -inf as the least where the divisor may be 0 (the
    rule may have no value)."""
    if numerator is None or divisor is None or divisor[1] <= 0:
        return None
    if divisor[0] <= 0:
        return -math.inf, math.inf
    return numerator[0] / divisor[1], numerator[1] / divisor[0]


def above(value: Bounds | None, threshold: float, inclusive: bool = False) -> tuple[bool, bool]:
    """(certainly, possibly) above the threshold."""
    if value is None:
        return False, False
    if inclusive:
        return value[0] >= threshold, value[1] >= threshold
    return value[0] > threshold, value[1] > threshold


def both(a: tuple[bool, bool], b: tuple[bool, bool]) -> tuple[bool, bool]:
    return a[0] and b[0], a[1] and b[1]


def busy(truth, seen, name, t):
    finished = seen_rate(truth, seen, name, "kvcache_e2e_request_latency_seconds_count", t)
    return above(finished, THRESHOLDS.traffic_floor_requests_per_second, inclusive=True)


def preempting_above(rate):
    def condition(truth, seen, name, t):
        preempting = seen_rate(truth, seen, name, "kvcache_preemptions_total", t)
        return both(above(preempting, rate), busy(truth, seen, name, t))
    return condition


def queue_dominates(truth, seen, name, t):
    share = quotient(seen_rate(truth, seen, name, "kvcache_queue_time_seconds_sum", t),
                     seen_rate(truth, seen, name, "kvcache_time_to_first_token_seconds_sum", t))
    return both(above(share, THRESHOLDS.queue_share_of_ttft), busy(truth, seen, name, t))


def hit_ratio_dropped(truth, seen, name, t):
    def hit_ratio(offset: float) -> Bounds | None:
        return quotient(seen_rate(truth, seen, name, "kvcache_prefix_cache_hit_tokens_total", t, offset),
                        seen_rate(truth, seen, name, "kvcache_prefix_cache_queried_tokens_total", t, offset))

    now, baseline = hit_ratio(0.0), hit_ratio(units.parse_duration(THRESHOLDS.prefix_hit_baseline_offset))
    queried = seen_rate(truth, seen, name, "kvcache_prefix_cache_queried_tokens_total", t)
    if now is None or baseline is None:
        return False, False
    fraction = THRESHOLDS.prefix_hit_drop_fraction
    dropped = now[1] < fraction * baseline[0], now[0] < fraction * baseline[1]
    return both(dropped, above(queried, THRESHOLDS.traffic_floor_prefix_tokens_per_second, inclusive=True))


# (alert name, severity) -> (condition: (certainly, possibly) at an evaluation, for)
RATE_ALERTS = {
    ("KVCachePreemptionStorm", "warning"): (preempting_above(THRESHOLDS.preemption_storm_warning_per_second),
                                            THRESHOLDS.preemption_storm_for),
    ("KVCachePreemptionStorm", "critical"): (preempting_above(THRESHOLDS.preemption_storm_critical_per_second),
                                             THRESHOLDS.preemption_storm_for),
    ("KVCachePrefixHitRateDrop", "warning"): (hit_ratio_dropped, THRESHOLDS.prefix_hit_drop_for),
    ("KVCacheQueueDominatesTTFT", "warning"): (queue_dominates, THRESHOLDS.queue_dominates_for),
}


def longest_hold(evaluations: list[float], holds) -> float:
    """The longest an alert with this condition stayed pending: from the first of consecutive evaluations at
    which it held to the last (it fires once that reaches its `for:`)."""
    longest, since = 0.0, None
    for t in evaluations:
        if holds(t):
            since = t if since is None else since
            longest = max(longest, t - since)
        else:
            since = None
    return longest


def expected_alerts(truth: Truth, seen: Seen) -> tuple[set, set]:
    """(alerts that must fire, alerts that may fire), each a set of (alertname, severity, target)."""
    must, may = set(), set()
    for (alertname, severity), (requires, allows, for_) in STATE_ALERTS.items():
        hold = units.parse_duration(for_)
        for name in FLEET:
            if max(held_runs(truth, name, requires)) >= hold + LAG_S:
                must.add((alertname, severity, name))
            if max(held_runs(truth, name, allows)) >= hold - LAG_S:
                may.add((alertname, severity, name))
    for (alertname, severity), (condition, for_) in RATE_ALERTS.items():
        hold = units.parse_duration(for_)
        for name in FLEET:
            judged = {t: condition(truth, seen, name, t) for t in seen.evaluations}
            if longest_hold(seen.evaluations, lambda t: judged[t][0]) >= hold:
                must.add((alertname, severity, name))
            if longest_hold(seen.evaluations, lambda t: judged[t][1]) >= hold:
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
    """The fleet's engines, and DOWN at a free loopback port."""
    down = {"name": DOWN, "url": f"http://127.0.0.1:{harness.free_port()}/metrics", "engine": "vllm",
            "labels": {"pool": "down"}}
    targets = [{"name": name, "url": url, "engine": engine_of(name), "labels": {"pool": FLEET[name][1]}}
               for name, url in urls.items()]
    return harness.polling([*targets, down], INTERVAL_S, TIMEOUT_S, STALENESS_S, THRESHOLDS, {"cluster": "truth"})


def sample_until(truth: Truth, engines: dict, stop: threading.Event) -> None:
    while not stop.wait(SAMPLE_S):
        for name, engine in engines.items():
            truth.record(name, engine)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    work = tmp_path_factory.mktemp("dashboards-truth")
    rules = work / "kvcache-rules.yml"
    rules.write_text(generate.render(generate.build(THRESHOLDS)))
    engines = {name: start_engine(flavor, scenario, speed=TIME_SCALE, seed=seed, dp=dp,
                                  served_history=SERVED_HISTORY, **overrides)
               for name, (flavor, scenario, dp, seed, overrides) in FLEET.items()}
    truth, stop = Truth(), threading.Event()
    try:
        config = work / "exporter.yml"
        config.write_text(yaml.safe_dump(exporter_config({name: e.url for name, e in engines.items()})))
        with harness.exporter(work, "--config", str(config)) as exporter:
            prometheus_config = harness.scraping(exporter, f"{INTERVAL_S:g}s", (rules,))
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
                for name, engine in engines.items():
                    truth.record_served(name, engine)
                yield Run(prometheus.url, truth, start, end, {n: e.model_name for n, e in engines.items()})
    finally:
        stop.set()
        for engine in engines.values():
            engine.stop()


@pytest.fixture(scope="module")
def seen(run):
    # From well before the run: the windows of the run's first evaluations (a baseline's too) reach back.
    return seen_by(run.prometheus_url, run.start - 30, run.end + LAG_S)


@pytest.fixture
def artifacts_on_failure(run, request, tmp_path):
    """When the test fails, draw both dashboards over the run as Grafana does into the test's tmp dir (the target
    dashboard on its first target), and print where."""
    failed_before = request.session.testsfailed
    yield
    # The call phase's report is logged before teardown, so a failure of this test is counted here.
    if request.session.testsfailed > failed_before:
        out = tmp_path / "grafana"
        result = render(run, out, sorted(build.GENERATED.glob("*.json")))
        print(f"\nthe dashboards as Grafana 12.4 draws them over the failed run: {out}/*/")
        print(result.stderr, end="")


# --- the dashboards as Grafana draws them -------------------------------------------------------

Drawn = grafana_render.Drawn


def drawn_at(run: Run) -> float:
    """The instant the dashboards are drawn at: LAG_S after the run, when Prometheus holds all of it; a whole
    second, so that a range query's last point (its end rounded down to the 1 s step) falls on it too."""
    return float(math.floor(run.end + LAG_S))


def over_the_run(run: Run) -> dict:
    """The drawing options of the dashboards over the run, as they stood at `drawn_at`."""
    end = drawn_at(run)
    return dict(end=end, range_seconds=end - run.start, scrape_interval_seconds=INTERVAL_S)


def render(run: Run, out, dashboards, variables: dict[str, str] | None = None):
    return grafana_render.render(run.prometheus_url, out, dashboards, **over_the_run(run), variables=variables)


@pytest.fixture(scope="module")
def grafana(run, tmp_path_factory):
    """Draws a dashboard (variables at All, or as chosen) once per module: each panel as drawn, by title."""
    grafana_render.build_page()
    drawn: dict[tuple, dict[str, Drawn]] = {}

    def draw(name: str, chosen: dict[str, str] | None = None) -> dict[str, Drawn]:
        key = (name, tuple(sorted((chosen or {}).items())))
        if key not in drawn:
            drawn[key] = grafana_render.draw(run.prometheus_url, tmp_path_factory.mktemp("grafana"),
                                             build.GENERATED / name, **over_the_run(run), variables=chosen)
        return drawn[key]

    return draw


@pytest.fixture(scope="module")
def fleet_all(grafana):
    return grafana(fleet.FILENAME)


def by_target(data: Drawn, ref: str = "A") -> dict[str, list[tuple[float, float]]]:
    return {labels.get("target", ""): [(t, v) for t, v in points if not math.isnan(v)]
            for labels, points in data.series[ref]}


def last(points: list[tuple[float, float]]) -> float:
    return points[-1][1]


# --- the checks ---------------------------------------------------------------------------------

def test_the_run_did_what_the_scenarios_say(run):
    """The ground truth itself: otherwise the checks below would check nothing."""
    truth = run.truth
    reasons = {name: {r.waiting_reason for ranks in truth.between(name, run.start, run.end) for r in ranks
                      if r.waiting} for name in FLEET}
    assert KV_SATURATION <= {n for n, why in reasons.items() if "kv" in why}
    assert {"vllm-cap", "sglang-cap"} <= {n for n, why in reasons.items() if "cap" in why}
    assert not set(KV_BOUND) & (reasons["vllm-cap"] | reasons["sglang-cap"] | reasons["vllm-steady"]
                                  | reasons["sglang-steady"])
    assert len(truth.at("sglang-sat-dp2", run.end)) == 2
    assert "wedged" in reasons["vllm-wedged"]
    assert truth.delta("vllm-wedged", run.end, 20.0, lambda r: r.prompted + r.generated) == 0  # stood still
    # TensorRT-LLM's engine preempts as the others do; it only has no counter to show it.
    assert truth.delta("trtllm-sat", run.end, run.end - run.start, lambda r: r.preemptions) > 0


@pytest.mark.usefixtures("artifacts_on_failure")
def test_every_ratio_is_within_0_and_1(run, fleet_all, grafana):
    # Hit ratio vs baseline is a ratio of ratios: above 1 when the cache does better than before.
    of_ratios = {"Hit ratio vs baseline"}
    for name, chosen in ((fleet.FILENAME, {}), (target.FILENAME, {"target": "sglang-sat-dp2"})):
        panels = grafana(name, chosen)
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


# The bounds the exporter re-exports by default (docs/metrics.md, "Latency buckets"), and +Inf.
KEPT_TTFT_BOUNDS = {*contract.DEFAULT_LATENCY_BUCKETS["time_to_first_token_seconds"], math.inf}


@pytest.mark.usefixtures("artifacts_on_failure")
def test_latency_quantiles_lie_in_the_bucket_the_engine_put_them_in(run, fleet_all, seen):
    """A fleet panel's per-target p90 TTFT sits in the bucket holding the engine's own 90th percentile, among the
    engine's bounds the exporter keeps."""
    # Prometheus' rate window [t - rate interval, t] starts and ends on scrapes, each of a known poll: the
    # engine increments it sees are those between the states the first and the last poll read.
    rate_interval = fleet_all["Time to first token p90"].rate_interval
    checked = 0
    for name, points in by_target(fleet_all["Time to first token p90"]).items():
        scrapes = seen.scrapes("kvcache_time_to_first_token_seconds_sum", name)  # the histogram's, as its buckets'
        for t, value in points[::5]:
            window = [seen.polls[name][scraped] for scraped in scrapes if t - rate_interval <= scraped <= t]
            if len(window) < 2:
                continue
            firsts, lasts = run.truth.polled(name, window[0]), run.truth.polled(name, window[-1])
            assert firsts and lasts, (name, t, "no page rendered during a poll")
            bounds = set()
            for now in lasts:
                for before in firsts:
                    counts = [(bound, sum(a.ttft_buckets[i][1] - b.ttft_buckets[i][1] for a, b in zip(now, before)))
                              for i, (bound, _) in enumerate(now[0].ttft_buckets) if bound in KEPT_TTFT_BOUNDS]
                    total = counts[-1][1]
                    if total:
                        index = next(i for i, (_, c) in enumerate(counts) if c >= 0.9 * total)
                        bounds |= {counts[index - 1][0] if index else 0.0, counts[index][0]}
            if len(bounds) >= 2 and math.isfinite(max(bounds)):
                # The rate of every bucket over the same scrapes: the p90 is interpolated inside the bucket
                # the engine's own counts put it in.
                assert min(bounds) - 1e-9 <= value <= max(bounds) + 1e-9, (name, t, value, sorted(bounds))
                checked += 1
    assert checked >= 20
    # The triage table's p90 of a target is that target's own line (one bucket layout each), at the same instant.
    table = fleet_all["Pools that need help now"]
    [ref] = [query["refId"] for query in table.panel["targets"] if query["legendFormat"] == "TTFT p90"]
    lines = by_target(fleet_all["Time to first token p90"])
    cells = by_target(table, ref)
    assert cells
    at = table.displayed["queries"][0]["time"]
    for name, points in cells.items():
        if not points:  # no first token within the rate interval (a wedged engine): no point on its line either
            assert at not in dict(lines.get(name, [])), name
            continue
        [(t, value)] = points
        assert value == pytest.approx(dict(lines[name])[t], rel=1e-6), name


def states_shown(run: Run, seen: Seen, family: str, t: float) -> dict[str, list[tuple[Rank, ...]]]:
    """For each target with a value of `family` at `t` (none where its values were stale, no headroom where
    nothing ran): the state read by the poll that value came from, the last scraped by then. Not the truth over
    the LAG_S before `t`: a stat counts each target as of its own poll, which with the machine busy can be older
    than LAG_S, and a pool's headroom moves between two samples of the truth (issue #28: `certain <=
    without_room` failed as 4 <= 3)."""
    result = harness.prom_query(run.prometheus_url, f'{family}{{cluster="truth"}}', time=t)["result"]
    return {name: read_at(run, seen, name, t) for name in {item["metric"]["target"] for item in result}}


def read_at(run: Run, seen: Seen, name: str, t: float) -> list[tuple[Rank, ...]]:
    """The states the target's poll shown at `t` read: the poll of its last scrape by then."""
    read = run.truth.polled(name, seen.polls[name][max(s for s in seen.polls[name] if s <= t)])
    assert read, (name, "no page rendered during the poll shown")
    return read


@pytest.mark.usefixtures("artifacts_on_failure")
def test_overview_shows_the_worst_pool(run, fleet_all, seen):
    [points] = by_target(fleet_all["Fullest pool's KV usage"]).values()  # one series: the fullest pool's
    t, usage = points[-1]
    fullest = [[max(r.usage for r in ranks) for ranks in read]
               for read in states_shown(run, seen, "kvcache_usage_ratio", t).values()]
    least, most = max(map(min, fullest)), max(map(max, fullest))
    assert least - 0.02 <= usage <= most + 0.02, (usage, least, most)
    # Headroom below 1 on a target's least-free rank: between the certain and the possible count.
    t, without_room = by_target(fleet_all["Pools without room for one more request"])[""][-1]
    shown = states_shown(run, seen, "kvcache_headroom_requests", t).values()
    certain = sum(all(any(map(surely_without_room, ranks)) for ranks in read) for read in shown)
    possible = sum(any(any(map(maybe_without_room, ranks)) for ranks in read) for read in shown)
    assert certain <= without_room <= possible, (certain, without_room, possible)
    # Lowest hit ratio and most preemptions are the extreme of the per-target lines, not a sum.
    hit = [last(points) for points in by_target(fleet_all["Prefix-cache hit ratio per target"]).values() if points]
    lowest = last(by_target(fleet_all["Lowest prefix-cache hit ratio"])[""])
    assert any(lowest == pytest.approx(ratio, abs=1e-9) for ratio in hit), (lowest, hit)
    # A hit ratio is low or high by its workload, not by a band: on no colour.
    assert [value["colorName"] for value in fleet_all["Lowest prefix-cache hit ratio"].displayed["values"]] == [None]
    most = last(by_target(fleet_all["Most preemptions per minute"])[""])
    per_target = by_target(fleet_all["Preemption rate per target"])
    assert most == pytest.approx(60 * max(last(p) for p in per_target.values() if p), rel=1e-6)


@pytest.mark.usefixtures("artifacts_on_failure")
def test_pressure_states_name_the_cause(run, fleet_all, seen):
    """Where the engine's queue waited on one cause over all the LAG_S Prometheus may lag (KV, whether or not a
    finish had just freed room for its head), and the page the lane's poll read shows that cause as such, the lane
    says it. Not where that page showed a head a finish had freed room for (reason "freed"): it shows a queue
    beside free blocks until the next step, and for TensorRT-LLM, whose gauges refresh only when a request
    finishes, until the next finish (issue #28: a TensorRT-LLM lane "capped" at usage 0.735)."""
    lanes = by_target(fleet_all["Pressure state over time"])
    checked = {"capped": 0, "kv": 0}

    def causes(states):
        return {("kv" if r.waiting_reason in KV_BOUND else r.waiting_reason) if r.waiting else None
                for ranks in states for r in ranks}

    for name in FLEET:
        recorded_from = run.truth.samples[name][0][0]
        for t, code in lanes[name]:
            # Only lag windows the truth saw whole: a lane's first points may show a state read before it began.
            window = run.truth.between(name, t - LAG_S, t)
            reasons = causes(window)
            if t - LAG_S < recorded_from or len(window) < 4 or len(reasons) != 1:
                continue
            [reason] = reasons
            read = read_at(run, seen, name, t)
            if {r.waiting_reason if r.waiting else None for ranks in read for r in ranks} != reasons:
                continue
            state = PRESSURE_STATES[int(code)]
            if reason == "kv" and any(r.shows_room for ranks in read for r in ranks):
                continue  # a KV-held queue beside room for a typical request: see STATES_OF_REASON
            if reason == "kv" and len(run.truth.at(name, t)) == 1:
                assert state in ("saturated", "thrashing"), (name, t, state)
                checked["kv"] += 1
            elif reason == "cap":
                assert state == "capped", (name, t, state)
                checked["capped"] += 1
        if name in STEADY | {"vllm-cap", "sglang-cap"}:
            assert all(PRESSURE_STATES[int(code)] not in ("saturated", "thrashing") for _, code in lanes[name]), name
    assert checked["capped"] >= 10 and checked["kv"] >= 10, checked


# --- what Grafana displays, against the engines' own state ------------------------------------------

# The exporter reads an SGLang pool's usage from its token_usage gauge, which SGLang (and the simulator) round to
# two decimals: the engine's own fill is within half a hundredth of it.
USAGE_ROUNDING = {"sglang": 0.005}
# The colours on-call reads the pressure states by, mildest first as PRESSURE_STATES.
SEVERITY_COLOURS = ("green", "yellow", "orange", "red", "dark-red")
# What the head of each rank's queue waits for (the model's reason) -> the states the exporter may show for the
# rank: a queue for KV is saturated, one behind the running cap capped, one behind the token budget either
# (the pool may be short too), one KV held back until a finish freed room either (the pool may still look short);
# no queue ok or tight; any of them thrashing while the engine preempts. A queue for KV whose page shows room for a
# typical request (Rank.shows_room: its head is long, or the engine's reserve for output to come holds it back)
# either: the contract's rule reads capped there (docs/metrics.md, "The pressure state"). Issue #28: vllm-offload
# read capped with one request queued for KV at usage 0.70, 78 blocks free and 59 per running request.
STATES_OF_REASON = {"kv": {"saturated"}, "cap": {"capped"}, "budget": {"capped", "saturated"},
                    "freed": {"capped", "saturated"}, "wedged": {"capped"}, None: {"ok", "tight"}}


def rank_states(rank: Rank) -> set[str]:
    """The pressure states a rank's page may read: its queue's reason's (STATES_OF_REASON), or thrashing."""
    states = STATES_OF_REASON[rank.waiting_reason if rank.waiting else None] | {"thrashing"}
    return states | {"capped"} if rank.waiting_reason == "kv" and rank.shows_room else states


def surely_without_room(rank: Rank) -> bool:
    """Whether the contract's headroom of a rank's page is below 1 whatever its state: less than one typical
    request free, or a page that can only read saturated or thrashing (headroom 0 then)."""
    return rank.headroom is not None and (rank.headroom < 1 or rank_states(rank) <= set(KV_SHORT_STATES))


def maybe_without_room(rank: Rank) -> bool:
    """Whether it may be: below one request, or a page that may read saturated or thrashing."""
    return rank.headroom is not None and (rank.headroom < 1 or bool(rank_states(rank) & set(KV_SHORT_STATES)))


def usage_colour(value: float) -> str:
    """The band of a KV usage, from exporter/thresholds.py's marks."""
    return "red" if value >= DEFAULT.high_water_ratio else "yellow" if value >= DEFAULT.low_water_ratio else "green"


def percent_interval(text: str) -> tuple[float, float]:
    """The ratios a percentage as Grafana writes it stands for: its number, give or take half its last digit."""
    match = re.fullmatch(r"\d+(?:\.(\d+))?%", text)
    assert match, f"not a percentage: {text!r}"
    half = 0.5 * 10 ** -len(match.group(1) or "")
    return (float(text[:-1]) - half) / 100, (float(text[:-1]) + half) / 100


def usage_bounds(run: Run, seen: Seen, t: float) -> dict[str, tuple[float, float]]:
    """Per target with a usage at `t`: the least and the most its fullest rank held in the states its poll read."""
    bounds = {}
    for name, read in states_shown(run, seen, "kvcache_usage_ratio", t).items():
        fills = [max(rank.usage for rank in ranks) for ranks in read]
        rounding = USAGE_ROUNDING.get(engine_of(name), 0.0) + 1e-9
        bounds[name] = (min(fills) - rounding, max(fills) + rounding)
    return bounds


def assert_shows_usage(shown: dict, low: float, high: float, where: str) -> None:
    """A KV usage as Grafana displays it: a percentage of a value between `low` and `high`, in that value's band."""
    shown_low, shown_high = percent_interval(shown["text"])
    both = max(low, shown_low), min(high, shown_high)
    assert both[0] <= both[1], (where, shown["text"], round(low, 4), round(high, 4))
    assert shown["colorName"] in {usage_colour(both[0]), usage_colour(both[1])}, (where, shown, low, high)


def possible_states(read: list[tuple[Rank, ...]]) -> set[str]:
    """The pressure states a target may show for the states its poll read: its worst rank's."""
    possible = set()
    for ranks in read:
        per_rank = [rank_states(rank) for rank in ranks]
        codes = [{PRESSURE_STATES.index(state) for state in states} for states in per_rank]
        worst = {max(combination) for combination in itertools.product(*codes)}
        possible |= {PRESSURE_STATES[code] for code in worst}
    return possible


def waiting_shown(row: dict[str, dict]) -> int:
    """A triage row's queue: its waiting for KV and waiting with KV room."""
    return int(row["Waiting for KV"]["text"]) + int(row["Waiting with KV room"]["text"])


@pytest.mark.usefixtures("artifacts_on_failure")
def test_grafana_shows_the_fullest_pool_in_its_unit_and_band(run, fleet_all, seen):
    """The stat on-call reads first: the fullest pool's fill in the states the polls behind it read, as a
    percentage (the engine's fraction, to Grafana's rounding), in the band exporter/thresholds.py puts it in."""
    stat = fleet_all["Fullest pool's KV usage"]
    [query] = stat.displayed["queries"]
    assert query["instant"] and query["time"] == drawn_at(run)  # the value now, of the pool it names
    bounds = usage_bounds(run, seen, query["time"])
    assert set(bounds) == set(FLEET)
    low, high = max(low for low, _ in bounds.values()), max(high for _, high in bounds.values())
    [shown] = stat.displayed["values"]
    assert_shows_usage(shown, low, high, "fullest pool")
    # It names its pool ("<target> rank <n>"), one whose fill the polls allow to be the fullest.
    name, _, rank = shown["name"].partition(" rank ")
    assert name in FLEET and rank.isdigit(), shown["name"]
    assert bounds[name][1] >= low, (shown["name"], bounds[name], low)


@pytest.mark.usefixtures("artifacts_on_failure")
def test_grafana_lists_the_pools_worst_first_with_their_state_and_colour(run, fleet_all, seen):
    """"Pools that need help now" as Grafana displays it: every target once, worst pressure state first, each
    state's word in its severity's colour and one the states its poll read allow; KV usage as the stat's."""
    table = fleet_all["Pools that need help now"]
    t = table.displayed["queries"][0]["time"]
    down, *rows = table.rows
    # The target the exporter cannot poll is the first row, as down, and shows no number (none is fresh).
    assert (down["target"]["text"], down["State"]["text"], down["State"]["colorName"]) == (
        DOWN, pressure.DOWN, bands.DOWN_COLOR), down
    assert {cell["text"] for column, cell in down.items() if column not in ("target", "State")} <= {"", "No data"}, down
    assert sorted(row["target"]["text"] for row in rows) == sorted(FLEET)
    words = {pressure.reason_words(THRESHOLDS, reason): reason for reason in PRESSURE_REASONS}
    reasons = [words[row["State"]["text"]] for row in rows]  # each State says its reason in the contract's words
    codes = [list(PRESSURE_REASONS).index(reason) for reason in reasons]
    assert codes == sorted(codes, reverse=True), [row["State"]["text"] for row in rows]
    # Ties by usage, fullest first (the cells' percentages, to Grafana's rounding), then by waiting, longest first.
    for above, below in zip(rows, rows[1:]):
        if above["State"]["text"] == below["State"]["text"]:
            assert percent_interval(above["KV usage"]["text"])[1] >= percent_interval(below["KV usage"]["text"])[0], (
                above["target"]["text"], below["target"]["text"])
            if above["KV usage"]["text"] == below["KV usage"]["text"]:
                assert waiting_shown(above) >= waiting_shown(below), (above["target"]["text"], below["target"]["text"])
    reads = states_shown(run, seen, "kvcache_pressure_state", t)
    usage = usage_bounds(run, seen, t)
    for row, reason in zip(rows, reasons):
        name, state, word = row["target"]["text"], row["State"], PRESSURE_REASONS[reason].state
        assert state["colorName"] == SEVERITY_COLOURS[PRESSURE_STATES.index(word)], (name, state)
        assert word in possible_states(reads[name]), (name, state["text"], reads[name])
        assert_shows_usage(row["KV usage"], *usage[name], name)
    # The run's point: saturated pools at the top (a queue for KV, or preempting), the steady ones below them.
    top = {row["target"]["text"] for row in rows[:len(KV_SATURATION)]}
    assert not top & STEADY, [(row["target"]["text"], row["State"]["text"]) for row in rows]
    # At 1,200 px nothing is cut short: no header, no cell (a reason's words, a name, a number), no column.
    assert table.displayed["clippedColumns"] == []
    assert [(row[0]["text"], cell["column"], cell["text"]) for row in table.displayed["rows"] for cell in row
            if cell["clipped"]] == []


@pytest.mark.usefixtures("artifacts_on_failure")
def test_a_value_the_engine_does_not_give_reads_no_data_not_a_band(run, fleet_all, seen):
    """TensorRT-LLM counts no preemptions: its Preempted per min cell reads "No data" on no colour (Grafana paints an
    empty cell in the first band's colour, green: "fine"). A pool where nothing ran has no headroom: "No data",
    not red. Every other cell holds a value; none is empty or NaN."""
    table = fleet_all["Pools that need help now"]
    rows = {row["target"]["text"]: row for row in table.rows}
    for name in WITHOUT_PREEMPTIONS:
        cell = rows[name]["Preempted per min"]
        assert (cell["text"], cell["colorName"]) == ("No data", None)
    for name in set(FLEET) - WITHOUT_PREEMPTIONS:
        assert re.fullmatch(r"[\d.]+", rows[name]["Preempted per min"]["text"]), rows[name]["Preempted per min"]
        assert rows[name]["Preempted per min"]["colorName"] is not None
    reads = states_shown(run, seen, "kvcache_usage_ratio", table.displayed["queries"][0]["time"])
    for name, read in reads.items():
        rooms = [[rank.headroom for rank in ranks if rank.headroom is not None] for ranks in read]
        shown = rows[name]["Headroom"]
        if not any(rooms):
            assert (shown["text"], shown["colorName"]) == ("No data", None), name
        elif all(rooms):
            assert shown["text"] != "No data", name
            # Red below one request that fits or while the pool waits for KV (headroom 0 then, by the contract).
            colours = ({"red" for ranks in read if any(map(maybe_without_room, ranks))}
                       | {"green" for ranks in read if not any(map(surely_without_room, ranks))})
            assert shown["colorName"] in colours, (name, shown, rooms)
    for name, row in rows.items():
        if name == DOWN:  # no number at all: test_grafana_lists_the_pools_worst_first_with_their_state_and_colour
            continue
        for column, cell in row.items():
            assert cell["text"] not in ("", "NaN"), (name, column, cell)
            # Coloured where the column's band or mapping means something; Running and TTFT have none: no colour.
            if column in ("target", "Running") or column.startswith("TTFT"):
                assert cell["colorName"] is None, (name, column, cell)
            else:
                assert cell["colorName"] is not None or cell["text"] == "No data", (name, column, cell)


# What on-call reads first about a pool, on either dashboard: one target of each kind (KV-short on two data-parallel
# ranks, capped, wedged, KV-short on an engine without a preemption counter, fine).
FIRST_SCREEN = ("sglang-sat-dp2", "vllm-cap", "vllm-wedged", "trtllm-sat", "vllm-steady")


def page_gives(reason: str, ranks: tuple[Rank, ...], preempted: float) -> bool:
    """Whether one page the poll read holds the numbers a reason's words state (contract.PRESSURE_REASONS), on the
    rank it is about: a queue at or above the low-water mark, less free than one live request, a queue beside room
    (with none running: one the engine does not admit),
    preemptions (`preempted`: the engine's own count over the window before), or none of these. Give or take a
    block or a rounding of usage (the engines' usage denominators differ by one, SGLang rounds to two decimals)."""
    slack = max(1.0 / ranks[0].num_blocks, max(USAGE_ROUNDING.values()))
    queues = [r for r in ranks if r.waiting]
    if reason == "room":
        return not queues
    if reason == "high_water":
        return not queues and max(r.usage for r in ranks) >= THRESHOLDS.high_water_ratio - slack
    if reason == "cap":
        return any(r.waiting_reason not in KV_BOUND or r.shows_room for r in queues)
    if reason == "admits_nothing":
        return any(not r.running and r.waiting_reason not in KV_BOUND for r in queues)
    if reason == "low_water":
        return any(r.usage >= THRESHOLDS.low_water_ratio - slack for r in queues)
    if reason == "free_below_request":
        return any(dataclasses.replace(r, used_blocks=r.used_blocks + 1).headroom < 1 for r in queues if r.running)
    if reason == "preempted":
        return bool(queues) and preempted > 0
    return preempted > 0  # "preemptions": thrashing


@pytest.mark.usefixtures("artifacts_on_failure")
def test_each_pool_says_why_with_the_engines_numbers(run, fleet_all, grafana, seen):
    """Each row of "Pools that need help now" says why in the contract's words, and those words hold on the page the
    engine served to the poll shown: the queue is at the usage, beside the room, or with the preemptions they say;
    the queue and the running requests beside them are the engine's own. The target dashboard's "Pressure state"
    says the same words in the same colour at the same instant, and its "Waiting requests" are the engine's."""
    table = fleet_all["Pools that need help now"]
    t = table.displayed["queries"][0]["time"]
    words = {pressure.reason_words(THRESHOLDS, reason): reason for reason in PRESSURE_REASONS}
    rows = {row["target"]["text"]: row for row in table.rows if row["target"]["text"] != DOWN}
    for name, row in rows.items():
        reason = words[row["State"]["text"]]
        read = read_at(run, seen, name, t)
        preempted = run.truth.delta(name, t, 2 * WINDOW_S, lambda r: r.preemptions)
        assert any(page_gives(reason, ranks, preempted) for ranks in read), (name, reason, read)
        assert int(row["Running"]["text"]) in {sum(r.running for r in ranks) for ranks in read}, (name, row["Running"])
        assert waiting_shown(row) in {sum(r.waiting for r in ranks) for ranks in read}, (name, read)
    for name in FIRST_SCREEN:
        panels = grafana(target.FILENAME, {"target": name})
        state, queue = panels["Pressure state"], panels["Waiting requests"]
        assert [query.get("time", query.get("end")) for query in state.displayed["queries"]] == [t], name
        [shown] = state.displayed["values"]
        assert (shown["text"], shown["colorName"]) == (rows[name]["State"]["text"], rows[name]["State"]["colorName"])
        at = queue.displayed["queries"][0].get("time", queue.displayed["queries"][0].get("end"))
        waiting = sum(value["numeric"] for value in queue.displayed["values"])
        assert waiting in {sum(r.waiting for r in ranks) for ranks in read_at(run, seen, name, at)}, (name, waiting)


@pytest.mark.usefixtures("artifacts_on_failure")
def test_the_state_counts_are_the_tables_rows(run, fleet_all):
    """"Targets per pressure state" counts what the table beside it lists: each target once, by its worst rank (the
    data-parallel SGLang target is one row and one count), the target that is down as down."""
    table = fleet_all["Pools that need help now"]
    t = table.displayed["queries"][0]["time"]
    stat = fleet_all["Targets per pressure state"]
    assert {query.get("time", query.get("end")) for query in stat.displayed["queries"]} == {t}  # the same instant
    state_of = {pressure.reason_words(THRESHOLDS, reason): PRESSURE_REASONS[reason].state
                for reason in PRESSURE_REASONS} | {pressure.DOWN: "down"}
    rows = collections.Counter(state_of[row["State"]["text"]] for row in table.rows)
    counts = {value["name"]: int(value["text"]) for value in stat.displayed["values"]}
    assert counts == {state: rows[state] for state in (*PRESSURE_STATES, "down")}, (counts, rows)
    assert sum(counts.values()) == len(FLEET) + 1
    up = {value["name"]: value["numeric"] for value in fleet_all["Targets up"].displayed["values"]}
    assert up == {"up": len(FLEET), "down": 1}, up
    # Colour where a band gives it a meaning: a count of targets up, or of fine ones, on none (the neutral band's
    # blue meant nothing); a state's count in its colour once a target is in it, green at none.
    colours = {value["name"]: value["colorName"] for value in fleet_all["Targets up"].displayed["values"]}
    assert colours == {"up": None, "down": "red"}, colours
    expected = {state: (bands.STATE_COLORS | {"down": bands.DOWN_COLOR})[state] if counts[state] else "green"
                for state in counts} | {"ok": None}
    assert {value["name"]: value["colorName"] for value in stat.displayed["values"]} == expected


@pytest.mark.usefixtures("artifacts_on_failure")
def test_legends_list_the_worst_first(run, fleet_all):
    """Every per-target time series lists its legend by the series' last value, worst first (descending where more
    is worse, ascending for headroom, time until full and hit ratio), and the rows it shows without scrolling are
    the LEGEND_ROWS pools to look at: those with the worst last values. The values are Prometheus' answers to the
    panel's own query, the last finite one of each line (Grafana's "Last *" skips the others)."""
    checked = 0
    for title, data in fleet_all.items():
        legend = data.panel.get("options", {}).get("legend", {})
        if (data.panel["type"] != "timeseries" or [q["legendFormat"] for q in data.panel["targets"]] != ["{{target}}"]
                or data.displayed.get("shows")):  # no series at all: no legend
            continue
        assert legend["sortBy"] == "Last *", title
        lasts = {name: finite[-1] for name, points in by_target(data).items()
                 if (finite := [v for _, v in points if math.isfinite(v)])}
        shown = [row["name"] for row in data.displayed["legend"]]
        assert set(shown) == set(lasts), (title, shown, sorted(lasts))
        values = [lasts[name] for name in shown]
        assert values == sorted(values, reverse=legend["sortDesc"]), (title, list(zip(shown, values)))
        # Ties at the cut may show either line: the visible rows' values are the worst LEGEND_ROWS values.
        visible = [row["name"] for row in data.displayed["legend"] if row["visible"]]
        worst = sorted(lasts.values(), reverse=legend["sortDesc"])[:LEGEND_ROWS]
        assert sorted(lasts[name] for name in visible) == sorted(worst), (title, visible, worst)
        checked += len(lasts) > LEGEND_ROWS
    assert checked >= 8, checked


@pytest.mark.usefixtures("artifacts_on_failure")
def test_state_timelines_say_what_each_colour_means(run, fleet_all):
    """Each state timeline's legend lists the states its lanes show, once each, in the order the lanes first show
    them (lanes in the order of Prometheus' answer to the panel's query, each from its start: Grafana's TimelineChart
    legend) and in the colour the panel's value mapping gives the state; nothing for a gap. "Pressure state over
    time" shows at least the run's saturated, capped and ok pools; "Targets up over time" the target that is down."""
    for title in ("Pressure state over time", "Targets up over time"):
        data = fleet_all[title]
        [names] = [m["options"] for m in data.panel["fieldConfig"]["defaults"]["mappings"] if m["type"] == "value"]
        codes = [int(v) for _, points in data.series["A"] for _, v in points if not math.isnan(v)]
        expected = [(names[str(code)]["text"], names[str(code)]["color"]) for code in dict.fromkeys(codes)]
        assert [(item["name"], item["colorName"]) for item in data.displayed["legend"]] == expected, title
    shown = {item["name"]: item["colorName"] for item in fleet_all["Pressure state over time"].displayed["legend"]}
    assert {state: bands.STATE_COLORS[state] for state in ("ok", "capped", "saturated")}.items() <= shown.items()
    assert ("down", "red") in [(i["name"], i["colorName"]) for i in fleet_all["Targets up over time"].displayed["legend"]]


@pytest.mark.usefixtures("artifacts_on_failure")
def test_no_data_only_where_the_engine_has_none_and_saying_why(run, grafana):
    """On the TensorRT-LLM target (no preemption counter) the preemption panels say once, in the panel's own size,
    which engines export none (their noValue), not a big "No data"; every other panel of the rows on-call reads
    first (Overview, KV, Pressure) has a value. The same panels on a vLLM target have their numbers."""
    trtllm, vllm = grafana(target.FILENAME, {"target": "trtllm-sat"}), grafana(target.FILENAME, {"target": "vllm-steady"})
    first_rows = {"Overview", "KV", "Pressure"}
    for title in ("Preemptions per minute", "Preemption rate per rank"):
        says = trtllm[title].panel["fieldConfig"]["defaults"]["noValue"]
        assert "TensorRT-LLM" in says and "vLLM" not in says, says
        shown = trtllm[title].displayed
        assert (shown.get("shows") or shown["values"][0]["text"]) == says, (title, shown)
        assert vllm[title].displayed.get("shows") is None and says not in json.dumps(vllm[title].displayed), title
    for title, data in trtllm.items():
        if data.displayed["row"] in first_rows and not title.startswith("Preemption"):
            texts = [value["text"] for value in data.displayed.get("values", [])] + [data.displayed.get("shows")]
            assert "No data" not in texts, (title, data.displayed)


@pytest.mark.usefixtures("artifacts_on_failure")
def test_firing_alerts_are_drawn_on_the_series_they_concern(run, fleet_all, seen):
    """Each firing alert is drawn as an annotation (from Prometheus' ALERTS, as Grafana's annotation query reads it)
    on the time series its annotation names, and only there: the KV shortage of each KV-saturated target on the
    waiting and headroom panels, not on the prefix cache's; the wedged engine's stall on every panel; the target
    that is down on "Targets up over time" only (a state timeline: on no time series). Each drawn region is a time
    at which Prometheus held the alert firing."""
    def drawn(title: str) -> set[tuple[str, str]]:
        events = fleet_all[title].displayed.get("annotations", [])
        return {(event["title"], event["text"].split(" ")[0]) for event in events}

    waiting = drawn("Waiting requests by cause per target")
    assert {("KVCacheShortageQueueing", name) for name in KV_SATURATION} <= waiting, waiting
    assert ("KVCacheShortageQueueing", "vllm-sat") in drawn("Headroom per target")
    assert not {event for event in drawn("Prefix-cache hit ratio per target") if event[0] == "KVCacheShortageQueueing"}
    for title in ("KV usage per target", "Waiting requests by cause per target", "Prefix-cache hit ratio per target"):
        assert ("KVCacheAdmissionStalled", "vllm-wedged") in drawn(title), title
    assert not {event for title in fleet_all for event in drawn(title) if event[0] == "KVCacheTargetDown"}
    ends = {(event["title"], event["text"].split(" ")[0], at) for data in fleet_all.values()
            for event in data.displayed.get("annotations", []) for at in (event["time"], event["timeEnd"])}
    for alertname, name, at in ends:
        firing = f'ALERTS{{alertstate="firing", alertname="{alertname}", target="{name}"}}'
        assert harness.prom_query(run.prometheus_url, firing, time=at / 1000)["result"], (alertname, name, at)
    assert len(ends) >= 8, ends


@pytest.mark.usefixtures("artifacts_on_failure")
def test_target_dashboard_shows_only_the_selected_target(run, grafana):
    for name in ("sglang-sat-dp2", "vllm-steady"):
        panels = grafana(target.FILENAME, {"target": name})
        for title, data in panels.items():
            for ref, series in data.series.items():
                assert {labels.get("target", name) for labels, _ in series} <= {name}, (title, ref)
        ranks = {labels.get("dp_rank") for labels, _ in panels["KV usage per rank"].series["A"]}
        assert len(ranks) == len(run.truth.at(name, run.end))
    dashboard = json.loads((build.GENERATED / target.FILENAME).read_text())
    drawn = []  # each firing alert is drawn by one annotation query (its own panels', or every panel's)
    for annotation in dashboard["annotations"]["list"]:
        expr = annotation["target"]["expr"].replace("$target", "vllm-steady")
        assert "$" not in expr, expr
        firing = harness.prom_query(run.prometheus_url, f"max_over_time(({expr})[{int(RUN_S + 2 * LAG_S)}s:1s])")
        assert {item["metric"].get("target", "") for item in firing["result"]} <= {"vllm-steady", ""}
        drawn += [(m["alertname"], m["severity"], m.get("target", ""))
                  for m in (item["metric"] for item in firing["result"])]
    assert len(drawn) == len(set(drawn)), drawn


@pytest.mark.usefixtures("artifacts_on_failure")
def test_alerts_fire_where_the_engines_were_in_trouble_and_nowhere_else(run, seen):
    seconds = int(run.end + LAG_S - run.start)
    result = harness.prom_query(run.prometheus_url, f'max_over_time(ALERTS{{alertstate="firing"}}[{seconds}s])',
                                time=run.end + LAG_S)["result"]
    # The engines of one flavor serve one model and carry different loads by design: the routing imbalance
    # across a model's replicas (no target; tests/e2e/test_fleet_e2e.py judges it) is left out here.
    fired = {(a["metric"]["alertname"], a["metric"]["severity"], a["metric"].get("target", "")) for a in result
             if a["metric"]["alertname"] != "KVCacheRoutingImbalance"}
    must, may = expected_alerts(run.truth, seen)
    # DOWN answers no poll from the start: its alert's window is all failures once Prometheus has held it `for:`.
    must, may = must | {("KVCacheTargetDown", "warning", DOWN)}, may | {("KVCacheTargetDown", "warning", DOWN)}
    assert must <= fired, f"missing: {sorted(must - fired)}"
    assert fired <= may, f"unexpected: {sorted(fired - may)}"
    assert not {a for a in fired if a[0] in NEVER}
    assert {a for a in fired if a[0] == "KVCacheTargetDown" or a[2] == DOWN} == {("KVCacheTargetDown", "warning", DOWN)}
    assert not {a for a in fired if a[2] in STEADY}, "an alert fired on a steady pool"
    # The scenarios' point, which the truth bands above must agree with.
    assert {("KVCacheShortageQueueing", "critical", n) for n in KV_SATURATION} <= fired
    assert not {a for a in fired if a[0] == "KVCachePreemptionStorm" and a[2] in WITHOUT_PREEMPTIONS}
    assert {("KVCacheQueueDominatesTTFT", "warning", n) for n in QUEUEING} <= fired
    assert ("KVCachePrefixHitRateDrop", "warning", "vllm-prefix") in fired
    # The wedged engine's stall pages, and is the only thing that fires there; it fires nowhere else.
    assert {a for a in fired if a[2] == "vllm-wedged"} == {("KVCacheAdmissionStalled", "critical", "vllm-wedged")}
    assert {a for a in fired if a[0] == "KVCacheAdmissionStalled"} == {
        ("KVCacheAdmissionStalled", "critical", "vllm-wedged")}
    assert not {a for a in fired if a[0] == "KVCacheShortageQueueing" and a[2] in ("vllm-cap", "sglang-cap")}


@pytest.mark.usefixtures("artifacts_on_failure")
def test_the_rules_rates_are_the_engines_over_the_same_scrapes(run, seen):
    """What the alerts above are judged on: each rate the recording rules wrote is the one the engine's own
    counts give over the scrapes its window held (`seen_rate`), to float rounding."""
    seconds = math.ceil(run.end + LAG_S - run.start)
    for record, family in (("kvcache:preemptions:rate", "kvcache_preemptions_total"),
                           ("kvcache:requests_finished:rate", "kvcache_e2e_request_latency_seconds_count"),
                           ("kvcache:prefix_cache_queried_tokens:rate", "kvcache_prefix_cache_queried_tokens_total")):
        result = harness.prom_query(run.prometheus_url, f'{record}{{cluster="truth"}}[{seconds}s]',
                                    time=run.end + LAG_S)["result"]
        checked = 0
        for item in result:
            name = item["metric"]["target"]
            for t, value in item["values"]:
                engines = seen_rate(run.truth, seen, name, family, float(t))
                assert engines is not None and engines[0] * (1 - 1e-6) <= float(value) <= engines[1] * (1 + 1e-6), (
                    record, name, round(float(t) - run.start, 2), value, engines,
                    window_held(seen, name, family, float(t)))
                checked += 1
        # About one evaluation a second of nearly every target (not TensorRT-LLM's preemptions, nor before the
        # first request finished).
        assert checked >= 0.7 * len(FLEET) * RUN_S / INTERVAL_S, (record, checked)


@pytest.mark.usefixtures("artifacts_on_failure")
def test_every_counter_prometheus_holds_is_the_engines_at_its_poll(run, seen):
    """Each sample of the counters the rate alerts read is the engine's own count in the state its poll read: a
    counter the exporter left frozen while it reported its target up (issue #28) is off at the next poll. And
    each is there at every scrape from its first one on while the target's values are fresh: the rate alerts
    above are judged on the scrapes that hold it."""
    checked = 0
    for family, value in RULE_COUNTERS.items():
        exposed = {name for name, series in seen.counters[family].items() if series}
        expected = set(FLEET) - (WITHOUT_PREEMPTIONS if family == "kvcache_preemptions_total" else set())
        assert exposed == expected, family
        for name, series in seen.counters[family].items():
            per_rank = set(series) != {"0"}
            for dp_rank, samples in series.items():
                scraped = [t for t, _ in samples]
                missing = [t for t, poll in seen.polls[name].items()
                           if t > scraped[0] and t - poll.end <= STALENESS_S - INTERVAL_S and t not in scraped]
                assert not missing, (family, name, dp_rank, [t - run.start for t in missing])
                for t, shown in samples:
                    read = run.truth.polled(name, seen.polls[name][t])
                    assert read, (name, round(t - run.start, 2), "no page rendered during the poll")
                    # Two states where a poll that had given up was answered late, inside the next one.
                    low, high = (engine_count(read[i], dp_rank, per_rank, value) for i in (0, -1))
                    assert low - 1e-9 * abs(low) <= shown <= high + 1e-9 * abs(high), (
                        family, name, dp_rank, round(t - run.start, 2), shown, low, high)
                    checked += 1
    # Six families of ten targets (less TensorRT-LLM's preemptions), scraped about once a second over the run.
    assert checked >= 0.8 * (6 * len(FLEET) - len(WITHOUT_PREEMPTIONS)) * RUN_S / INTERVAL_S, checked


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
def test_hits_by_source_follow_the_engines_tier(run, grafana):
    """The offload target's prefix hits split by source as its model counted them: over the run the CPU tier
    served more than the GPU pool, and the panel's shares, each a share of the same looked-up tokens, say so;
    the GPU share is the prefix-cache hit ratio of the same target, and all sources together the sum."""
    truth, name = run.truth, "vllm-offload"
    span = run.end - run.start
    cpu, gpu = (truth.delta(name, run.end, span, lambda r: getattr(r, field)) for field in ("offload_hits", "hits"))
    assert cpu > gpu > 0, (cpu, gpu)
    panels = grafana(target.FILENAME, {"target": name})
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
