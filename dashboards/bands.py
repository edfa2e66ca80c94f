"""Colour bands of the panels, drawn from exporter/thresholds.py.

Every tunable number here is a field of `Thresholds`: the exporter's pressure state and the
alert rules read the same fields, so a panel turns red where the state or the alert does.
The only literal is the count of 1 in `any_present`: "one or more" is the definition of
those signals (a target down, a request queued for KV), not a tunable.
"""

from __future__ import annotations

from grafana_foundation_sdk.builders import dashboard as builders
from grafana_foundation_sdk.models import dashboard as models

from kvcache_exporter.thresholds import Thresholds

Steps = tuple[tuple[float | None, str], ...]
"""(lower bound, colour) pairs; the first bound is None (everything below the next step)."""

# The colour of each of the exporter's pressure states (exporter.contract.PRESSURE_STATES).
DOWN_COLOR = "purple"  # a target the exporter cannot poll: no state, and no green either
STATE_COLORS = {"ok": "green", "tight": "yellow", "capped": "orange", "saturated": "red", "thrashing": "dark-red"}
# Headroom below one request: the next typical request does not fit (a definition, not a tunable).
ONE_REQUEST = 1


def usage(t: Thresholds) -> Steps:
    """KV pool fill (0..1): amber from the low-water mark, red from the high-water mark."""
    return ((None, "green"), (t.low_water_ratio, "yellow"), (t.high_water_ratio, "red"))


def preemption_rate(t: Thresholds, per_seconds: float = 1.0) -> Steps:
    """Preemptions per `per_seconds`: red at the rate that makes a target `thrashing`,
    dark red at the critical preemption-storm rate."""
    return (
        (None, "green"),
        (t.thrashing_preemptions_per_second * per_seconds, "red"),
        (t.preemption_storm_critical_per_second * per_seconds, "dark-red"),
    )


def preempted_share(t: Thresholds) -> Steps:
    """Preemptions as a share of completions: red where the autoscaling signal counts them as demand."""
    return ((None, "green"), (t.preemption_demand_share, "red"))


def queue_share(t: Thresholds) -> Steps:
    """Share of TTFT spent queueing: red where KVCacheQueueDominatesTTFT would fire."""
    return ((None, "green"), (t.queue_share_of_ttft, "red"))


def time_to_first_token(t: Thresholds) -> Steps:
    """Seconds to the first token: red above the bound past which KVCacheShortageQueueing pages."""
    return ((None, "green"), (t.shortage_critical_ttft_seconds, "red"))


def hit_ratio_vs_baseline(t: Thresholds) -> Steps:
    """Hit ratio as a fraction of its baseline: red below the KVCachePrefixHitRateDrop fraction."""
    return ((None, "red"), (t.prefix_hit_drop_fraction, "green"))


def headroom() -> Steps:
    """Requests that still fit: red below one."""
    return ((None, "red"), (ONE_REQUEST, "green"))


def sooner_than(seconds: float) -> Steps:
    """A time left: red below `seconds`."""
    return ((None, "red"), (seconds, "green"))


def any_present(color: str = "red") -> Steps:
    """A count where one or more is the problem (targets down, requests queued for KV)."""
    return ((None, "green"), (1, color))


def neutral() -> Steps:
    """No band: the panel explains a signal whose red lives on another panel."""
    return ((None, "blue"),)


def config(steps: Steps) -> builders.ThresholdsConfig:
    return builders.ThresholdsConfig().mode(models.ThresholdsMode.ABSOLUTE).steps(
        [models.Threshold(value=value, color=color) for value, color in steps]
    )
