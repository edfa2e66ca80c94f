"""PromQL over the kvcache_* contract, written once for both dashboards.

The rules the lint test checks are made here, so a panel cannot get them wrong by hand:
counters appear only inside rate()/increase() over $__rate_interval, a ratio is a quotient
of sums with a guarded denominator (never an average of per-target ratios, never lifetime
counters), and a quantile is taken over `sum by (le, target, ...)` of bucket rates: the
engines bucket differently (vLLM's queue time starts at 0.3 s, SGLang's TTFT at 0.1 s), and a
quantile over a sum of unlike buckets is no quantile of anything.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvcache_exporter import contract

RATE_INTERVAL = "$__rate_interval"
# The identity labels of a pool's series (the widest a dashboard filters on).
POOL_LABELS = frozenset(contract.GROUPS["pool"].identity)


@dataclass(frozen=True)
class Scope:
    """The labels a dashboard's variables filter on; each variable is named after its label."""

    labels: tuple[str, ...]
    matchers: tuple[str, ...] = ()  # written into every selector as they are (`role=~"prefill|decode"`)

    def selector(self, metric: str, **fixed: str) -> str:
        """`metric{label=~"$label", ..., fixed="value"}` for the labels this metric carries (a per-target
        family has no `model` or `dp_rank`)."""
        labels = self.labels
        family = contract.family_of(metric)
        if family is not None:
            missing = POOL_LABELS - set(family.identity)
            labels = tuple(label for label in labels if label not in missing)
        matchers = [f'{label}=~"${label}"' for label in labels]
        matchers += self.matchers
        matchers += [f'{label}="{value}"' for label, value in fixed.items()]
        return f"{metric}{{{', '.join(matchers)}}}" if matchers else metric


def _by(labels: tuple[str, ...]) -> str:
    return f" by ({', '.join(labels)})" if labels else ""


def total(scope: Scope, metric: str, by: tuple[str, ...] = (), **fixed: str) -> str:
    """Sum of a gauge over the selection, kept apart by `by`."""
    return f"sum{_by(by)} ({scope.selector(metric, **fixed)})"


def summed(expr: str, by: tuple[str, ...] = ()) -> str:
    """Sum of an expression's series, kept apart by `by`."""
    return f"sum{_by(by)} ({expr})"


def highest(scope: Scope, metric: str, by: tuple[str, ...] = ()) -> str:
    """Largest value of a gauge, for values every series repeats rather than adds (durations, timestamps)."""
    return f"max{_by(by)} ({scope.selector(metric)})"


def windowed(scope: Scope, counter: str, offset: str = "", **fixed: str) -> str:
    """The counter's per-second rate over Grafana's rate interval (optionally `offset` back in time)."""
    shift = f" offset {offset}" if offset else ""
    return f"rate({scope.selector(counter, **fixed)}[{RATE_INTERVAL}]{shift})"


def rate(scope: Scope, counter: str, by: tuple[str, ...] = (), offset: str = "", **fixed: str) -> str:
    """Per-second rate of a counter, summed over the selection and kept apart by `by`."""
    return f"sum{_by(by)} ({windowed(scope, counter, offset, **fixed)})"


def ratio(numerator: str, denominator: str) -> str:
    """numerator / denominator, with no result (rather than NaN or Inf) where the denominator is 0."""
    return f"{numerator} / ({denominator} > 0)"


def scaled(expr: str, factor: float) -> str:
    return f"{expr} * {factor:g}"


def rate_ratio(scope: Scope, part: str, whole: str, by: tuple[str, ...] = (), offset: str = "") -> str:
    """Windowed share of one counter in another: sum(rate(part)) / sum(rate(whole))."""
    return ratio(rate(scope, part, by, offset), rate(scope, whole, by, offset))


def rate_share_by(scope: Scope, part: str, whole: str, label: str, by: tuple[str, ...] = ()) -> str:
    """Windowed share of `whole` per value of a label only `part` has (e.g. hits per `source` in the tokens
    looked up): sum by (by, label) (rate(part)) / on (by) group_left sum by (by) (rate(whole))."""
    return f"{rate(scope, part, (*by, label))} / on ({', '.join(by)}) group_left () ({rate(scope, whole, by)} > 0)"


def gauge_ratio(scope: Scope, part: str, whole: str, by: tuple[str, ...] = ()) -> str:
    """sum(part) / sum(whole): the correct aggregate of a ratio of gauges across pools."""
    return ratio(total(scope, part, by), total(scope, whole, by))


# A quantile keeps one of these labels, so its buckets all come from one engine's layout.
ONE_BUCKET_LAYOUT = ("target", "engine")


def quantile(q: float, scope: Scope, histogram: str, by: tuple[str, ...]) -> str:
    """q-quantile of a contract histogram over the window, one per `by` group (which keeps a target or engine)."""
    if not set(by) & set(ONE_BUCKET_LAYOUT):
        raise ValueError(f"a quantile by {by} would sum unlike bucket layouts: keep one of {ONE_BUCKET_LAYOUT}")
    return f"histogram_quantile({q:g}, {bucket_rate(scope, histogram, by)})"


def worst(expr: str, by: tuple[str, ...] = ()) -> str:
    """The largest value of an expression's series (e.g. the slowest target's quantile)."""
    return f"max{_by(by)} ({expr})"


def least(expr: str, by: tuple[str, ...] = ()) -> str:
    """The smallest value of an expression's series (e.g. the pool with the least headroom)."""
    return f"min{_by(by)} ({expr})"


def at_most_one(expr: str) -> str:
    """A share bounded to [0, 1]: counters sampled at different moments can overshoot 1 briefly."""
    return f"clamp_max({expr}, 1)"


def share_of_sums(scope: Scope, part: str, whole: str, by: tuple[str, ...], busy: str) -> str:
    """sum(rate(part_sum)) / sum(rate(whole_sum)) of two histograms, in [0, 1], where `busy` holds.

    A ratio of the seconds the two histograms accumulate: no bucket enters it, so unlike
    bucket layouts cannot bend it the way a quotient of two interpolated quantiles bends.
    """
    share = at_most_one(ratio(rate(scope, part + "_sum", by), rate(scope, whole + "_sum", by)))
    return only_where(share, busy, by)


def bucket_rate(scope: Scope, histogram: str, by: tuple[str, ...] = ()) -> str:
    return f"sum by ({', '.join(('le', *by))}) ({windowed(scope, histogram + '_bucket')})"


def bucket_increase(scope: Scope, histogram: str) -> str:
    """Observations per bucket and interval, the input of a heatmap of pre-bucketed data (one target)."""
    return f"sum by (le, target) (increase({scope.selector(histogram + '_bucket')}[{RATE_INTERVAL}]))"


def at_least(expr: str, floor: float) -> str:
    return f"({expr}) >= {floor:g}"


def only_where(expr: str, condition: str, on: tuple[str, ...]) -> str:
    """`expr` kept only for the label sets (on `on`) where `condition` has a result."""
    return f"(({expr}) and on ({', '.join(on)}) ({condition}))"


def rank_of_states(scope: Scope, metric: str, states: tuple[str, ...], by: tuple[str, ...], label: str = "state") -> str:
    """Index in `states` of the current state (the one series at 1), worst over the rest of the labels.

    The state-set gauge has one series per state (its `label`) at 1 or 0; multiplying each by its index and
    taking the max leaves the index of the worst state any pool in the group is in.
    """
    ranked = " or ".join(
        f"{scope.selector(metric, **{label: state})} * {index}" for index, state in enumerate(states)
    )
    return f"max{_by(by)} ({ranked})"


def count_where(expr: str) -> str:
    """How many series of `expr` (a filter such as `x < 1`) exist; 0 when none."""
    return f"count ({expr}) or vector(0)"


def count_in_state(scope: Scope, metric: str, states: tuple[str, ...], state: str, per: tuple[str, ...]) -> str:
    """How many `per` groups (e.g. targets) have `state` as their worst (rank_of_states); 0 when none. Each group
    counts once, so the counts add up to the groups."""
    return f"count (({rank_of_states(scope, metric, states, per)}) == {states.index(state)}) or vector(0)"


# What more KV would buy: the capacity misses a larger pool would have kept, from the distance histogram
# the exporter fills from the KV event streams (exporter/blocks.py). Used by the rules and the panels alike.
def le_matcher(bound: float) -> str:
    """PromQL matcher of the bucket at `bound`, a regex: Prometheus 2 keeps `le` as the exporter writes it
    ("1.0"), a scrape in another format or Prometheus 3's normalisation may spell it "1"."""
    if bound == int(bound):
        return f'le=~"{int(bound)}|{int(bound)}.0"'
    return f'le=~"{bound:g}"'


def kept_misses(factor: float, buckets: str, window: str) -> str:
    """Capacity-miss blocks per second a pool `factor` times as large would have kept (distance ratio <= factor
    - 1), per pool (with `le` still on). `buckets` selects the distance histogram's buckets (`name` or
    `name{matchers}`)."""
    matcher = le_matcher(factor - 1)  # a bucket of its own (contract.WHAT_IF_FACTORS)
    selector = f"{buckets[:-1]}, {matcher}}}" if buckets.endswith("}") else f"{buckets}{{{matcher}}}"
    return f"rate({selector}[{window}])"


# Disaggregated prefill/decode: P/D backpressure per group, as the rule records it and the fleet panel draws it.
def pd_backpressure(decode_waiting: str, prefill_pools: str, group: str, newline: str = " ") -> str:
    """Decode-side transfers waiting for KV (`decode_waiting` selects kvcache_kv_transfer_requests_waiting_for_kv
    on decode pools) summed per P/D group, where the group has prefill pools (`prefill_pools` selects a gauge
    every prefill pool has). `newline` joins the terms (the rules break the line)."""
    return (f"sum by ({group}) ({decode_waiting}) > 0{newline}and on ({group}){newline}"
            f"group by ({group}) ({prefill_pools})")
