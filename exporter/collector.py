"""Renders the latest poll outcomes of all targets into the kvcache_* contract."""

from __future__ import annotations

import time
from typing import Callable, Iterable, Iterator

from prometheus_client.core import Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from . import __version__, contract
from .derive import PRESSURE_STATES
from .target import FAILURE_REASONS, Target

P = contract.PREFIX


class ExporterState:
    """The exporter's own state worth exposing: the outcome of configuration reloads."""

    def __init__(self) -> None:
        self.reload_ok = True
        self.reload_time = time.time()

    def reload_succeeded(self) -> None:
        self.reload_ok, self.reload_time = True, time.time()

    def reload_failed(self) -> None:
        self.reload_ok = False


class KVCacheCollector(Collector):
    """The contract for `targets`; with `state`, the exporter's own series too (the /probe output has none)."""

    def __init__(self, targets: Callable[[], Iterable[Target]], staleness: Callable[[], float],
                 state: ExporterState | None = None):
        self._targets = targets
        self._staleness = staleness
        self._state = state

    def collect(self) -> Iterator[Metric]:
        now = time.time()
        families: dict[str, Metric] = {}

        def family(name: str, kind: str, help_text: str) -> Metric:
            if name not in families:
                families[name] = Metric(P + name, help_text, kind)
            return families[name]

        if self._state is not None:
            for name, (kind, help_text, value) in {
                contract.BUILD_INFO[0]: ("gauge", contract.BUILD_INFO[1], 1.0),
                contract.RELOAD_OK[0]: ("gauge", contract.RELOAD_OK[1], float(self._state.reload_ok)),
                contract.RELOAD_TIME[0]: ("gauge", contract.RELOAD_TIME[1], self._state.reload_time),
            }.items():
                labels = {"version": __version__} if name == contract.BUILD_INFO[0] else {}
                family(name, kind, help_text).add_sample(P + name, labels, value)
        for name, (kind, help_text) in contract.TARGET_FAMILIES.items():
            family(name, kind, help_text)
        staleness = self._staleness()
        for target in self._targets():
            self._target_series(target, family, now, staleness)
        yield from families.values()

    def _target_series(self, target: Target, family, now: float, staleness: float) -> None:
        outcome = target.outcome
        base = {"target": target.name, "engine": outcome.engine, **target.labels}
        family("target_up", "", "").add_sample(P + "target_up", base, 1.0 if outcome.up else 0.0)
        if outcome.duration is not None:
            family("target_scrape_duration_seconds", "", "").add_sample(
                P + "target_scrape_duration_seconds", base, outcome.duration)
        if outcome.last_success is not None:
            family("target_last_success_timestamp_seconds", "", "").add_sample(
                P + "target_last_success_timestamp_seconds", base, outcome.last_success)
        failures = family("target_scrape_failures", "", "")
        for reason in FAILURE_REASONS:
            failures.add_sample(P + "target_scrape_failures_total", {**base, "reason": reason},
                                float(target.failures[reason]))
        family("target_info", "", "").add_sample(
            P + "target_info", {**base, "url": target.config.url, "version": ""}, 1.0)
        # Values older than the staleness period vanish rather than freeze at their last reading.
        if outcome.last_success is None or now - outcome.last_success > staleness:
            return
        for rank_name, rank in outcome.ranks.items():
            labels = {"target": target.name, "engine": outcome.engine, "model": outcome.model,
                      "dp_rank": rank_name, **target.labels}
            for name, value in rank.gauges.items():
                family(name, "gauge", contract.RANK_GAUGES[name]).add_sample(P + name, labels, value)
            for name, value in rank.values.counters.items():
                base_name = name.removesuffix("_total")
                family(base_name, "counter", contract.COUNTERS[name]).add_sample(P + name, labels, value)
            for name, histogram in rank.values.histograms.items():
                metric = family(name, "histogram", contract.HISTOGRAMS[name])
                for bound, count in histogram.buckets:
                    metric.add_sample(P + name + "_bucket", {**labels, "le": floatToGoString(bound)}, count)
                metric.add_sample(P + name + "_count", labels, histogram.count)
                metric.add_sample(P + name + "_sum", labels, histogram.sum)
            if rank.pressure is not None:
                metric = family(contract.PRESSURE_STATE[0], "gauge", contract.PRESSURE_STATE[1])
                for state in PRESSURE_STATES:
                    metric.add_sample(P + "pressure_state", {**labels, "state": state},
                                      1.0 if state == rank.pressure else 0.0)
