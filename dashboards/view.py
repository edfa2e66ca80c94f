"""What a dashboard looks at (`View`) and the units its panels use."""

from __future__ import annotations

from dataclasses import dataclass, replace

from kvcache_exporter import contract
from kvcache_exporter.config import DEFAULT_PD_GROUP_LABEL
from kvcache_exporter.thresholds import Thresholds

from kvcache_exporter.dashboards.panels import Link
from kvcache_exporter.dashboards.promql import Scope

# Units. Grafana's `count:<what>` prints a scaled count followed by <what>.
RATIO = "percentunit"
SECONDS = "s"
BYTES = "bytes"
TOKENS = "count:tokens"
BLOCKS = "count:blocks"
REQUESTS = "count:requests"
HEADROOM_UNIT = "count:requests"
TARGETS = "none"  # the title names what is counted; count:targets would write "1 targets", and "targets" under "Pools"
TOKENS_PER_SECOND = "count:tokens/s"
BYTES_PER_SECOND = "Bps"
PREEMPTIONS_PER_SECOND = "count:preemptions/s"
PREEMPTIONS_PER_MINUTE = "count:preemptions/min"
FAILURES_PER_SECOND = "count:failures/s"

# Exporter-health series exist once per target, whatever the view splits the pools by.
PER_TARGET = ("target",)
# The labels of one KV pool: vectors of two per-pool gauges match on these.
POOL = ("target", "dp_rank")


@dataclass(frozen=True)
class View:
    """What a dashboard looks at and how it splits it.

    The fleet dashboard looks at many targets and keeps one line per target; the target
    dashboard looks at one and keeps one line per data-parallel rank. Everything else about a
    panel (query, unit, bands, the advice for when it is red) is the same signal.
    """

    scope: Scope
    split: tuple[str, ...]  # labels that keep one line apart from another
    per: str  # what one line is, for titles: "per target", "per rank"
    legend: str  # legend of one such line
    thresholds: Thresholds
    latency_quantiles: tuple[float, ...]  # quantiles a latency panel draws, each per target
    drill_down: tuple[Link, ...] = ()  # data links on lines that carry a `target` label
    pd_group: str = DEFAULT_PD_GROUP_LABEL  # the label that groups prefill and decode pools (pd_group_label)

    def selector(self, metric: str, **fixed: str) -> str:
        return self.scope.selector(metric, **fixed)

    def disaggregated(self) -> "View":
        """The same view over the pools of disaggregated serving only: a unified pool's stage gauge (vLLM with an
        offload connector) counts its loads from the offload tier, no transfer between pools."""
        roles = f'role=~"{"|".join(contract.DISAGGREGATED_ROLES)}"'
        return replace(self, scope=replace(self.scope, matchers=(*self.scope.matchers, roles)))

    @property
    def one_target(self) -> bool:
        """The target dashboard's view: one target, its lines per rank (a fleet title's "most" or "lowest" of
        targets does not fit it)."""
        return "dp_rank" in self.split

    def line(self, what: str = "") -> str:
        return f"{self.legend} {what}".strip()


def legend_of(labels: tuple[str, ...], what: str = "") -> str:
    """A legend naming the series by `labels` (e.g. `{{target}} p90`)."""
    return " ".join([*("{{" + label + "}}" for label in labels), what]).strip()


def percent(value: float) -> str:
    return f"{value:.0%}"
