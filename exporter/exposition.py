"""Renders the kvcache_* contract as Prometheus text format 0.0.4.

Each target's lines are rendered once, after its poll (in the poll worker), grouped by family;
a scrape of /metrics then only concatenates them family by family. At 2,000 targets that keeps
a scrape to a join of strings, where building prometheus_client Metric objects for every sample
at every scrape takes seconds (bench/render.py measures both).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable

from prometheus_client.utils import floatToGoString

from . import contract
from .snapshot import RankValues

P = contract.PREFIX


# Each family's HELP and TYPE lines, in the order the families are exposed, by the name without the prefix.
HEADERS = {name: f"# HELP {family.metric} {family.help}\n# TYPE {family.metric} {family.type}\n".encode()
           for name, family in contract.FAMILIES.items()}


def label_text(labels: dict[str, str]) -> str:
    """`a="1",b="2"` with the text format's escapes."""
    return ",".join(f'{name}="{_escape(value)}"' for name, value in labels.items())


def _escape(value: str) -> str:
    if "\\" in value or "\n" in value or '"' in value:
        return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')
    return value


def number(value: float) -> str:
    """A sample value as the text format writes it (repr is exact and short; Go spells the specials)."""
    if value != value:
        return "NaN"
    if value in (_INF, -_INF):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


_INF = float("inf")


class _Spelled(float):
    """A value whose repr is its text-format spelling: NaN, +Inf and -Inf as Go writes them."""

    def __repr__(self) -> str:
        return number(self)


def line(name: str, labels: str, value: float) -> str:
    if not labels:
        return f"{name} {number(value)}\n"
    return f"{name}{{{labels}}} {number(value)}\n"


class Prefixes(dict):
    """`name{labels} ` strings of one target, built once and reused at every poll: only values change. Also the
    lines of its histograms by (family, labels), with the Histogram object they were rendered from: the adapter
    hands the same object again while the engine's histogram has not changed (Adapter.adapt's memo)."""

    def __init__(self) -> None:
        super().__init__()
        self.histogram_lines: dict[tuple[str, str], tuple[object, str]] = {}

    def __missing__(self, key: tuple) -> str:
        name, labels, extra = key
        self[key] = prefix = f"{name}{{{labels}{extra}}} "
        return prefix

    def histogram(self, name: str, labels: str, bounds: tuple[float, ...]) -> str:
        """A %-template of a histogram's lines (buckets, count, sum), to fill with the values' reprs:
        one formatting operation per histogram instead of a concatenation per line."""
        key = (name, labels, bounds)
        template = self.get(key)
        if template is None:
            bucket = P + name + "_bucket"
            prefixes = [f"{bucket}{{{labels}{_le(bound)}}} " for bound in bounds]
            prefixes += [f"{P}{name}_count{{{labels}}} ", f"{P}{name}_sum{{{labels}}} "]
            template = self[key] = "".join(prefix.replace("%", "%%") + "%r\n" for prefix in prefixes)
        return template


@dataclass(frozen=True)
class TargetText:
    """One target's lines by family, encoded: `status` always shows, `series` only while fresh.
    Kept as bytes so that a scrape joins them once, with no second copy of the whole body."""

    status: dict[str, bytes] = field(default_factory=dict)
    series: dict[str, bytes] = field(default_factory=dict)
    last_success: float | None = None


def render_target(name: str, labels: dict[str, str], url: str, outcome, failures: dict[str, int],
                  prefixes: Prefixes) -> TargetText:
    """The lines of one target from its latest poll outcome (exporter.runtime.target.PollOutcome); `prefixes` is
    the target's cache, to be replaced when its name or labels change."""
    base = label_text({"target": name, "engine": outcome.engine, **labels})
    status = {
        "target_up": line(P + "target_up", base, 1.0 if outcome.up else 0.0),
        "target_scrape_failures_total": "".join(
            line(P + "target_scrape_failures_total", f'{base},reason="{reason}"', float(count))
            for reason, count in failures.items()),
        "target_info": line(P + "target_info", f'{base},url="{_escape(url)}",version="{_escape(outcome.version)}"',
                            1.0),
        "target_replica_info": line(
            P + "target_replica_info", f'{base},model="{_escape(outcome.model)}",role="{_escape(outcome.role)}"', 1.0),
    }
    if outcome.duration is not None:
        status["target_scrape_duration_seconds"] = line(P + "target_scrape_duration_seconds", base, outcome.duration)
    if outcome.last_success is not None:
        status["target_last_success_timestamp_seconds"] = line(
            P + "target_last_success_timestamp_seconds", base, outcome.last_success)
    series: dict[str, list[str]] = {}
    for rank_name, rank in outcome.ranks.items():
        rank_labels = label_text({"target": name, "engine": outcome.engine, "model": outcome.model,
                                  "dp_rank": rank_name, "role": outcome.role, **labels})
        _pool_lines(series, prefixes, rank_labels, rank.gauges, rank.values, rank.labelled)
        if rank.pressure is not None:
            series.setdefault("pressure_state", []).extend(
                prefixes[P + "pressure_state", rank_labels, f',state="{state}"']
                + ("1.0\n" if state == rank.pressure else "0.0\n")
                for state in contract.PRESSURE_STATES)
        if rank.reason is not None:
            series.setdefault("pressure_reason", []).extend(
                prefixes[P + "pressure_reason", rank_labels, f',reason="{reason}"']
                + ("1.0\n" if reason == rank.reason else "0.0\n")
                for reason in contract.PRESSURE_REASONS)
    return TargetText({family: text.encode() for family, text in status.items()},
                      {family: "".join(lines).encode() for family, lines in series.items()}, outcome.last_success)


def render_pool(labels: dict[str, str], values: RankValues, prefixes: Prefixes) -> TargetText:
    """One pool's lines that show whatever their age (a KV event stream's: exporter.runtime.subscriber);
    `labels` are the pool's identity and static labels, `prefixes` the pool's cache."""
    series: dict[str, list[str]] = {}
    _pool_lines(series, prefixes, label_text(labels), values.gauges, values, values.labelled)
    return TargetText({family: "".join(lines).encode() for family, lines in series.items()})


def _pool_lines(series: dict[str, list[str]], prefixes: Prefixes, labels: str, gauges: dict[str, float],
                values: RankValues, labelled: dict[str, dict[tuple[str, ...], float]]) -> None:
    """Appends one pool's samples to `series`, by family: its gauges, the counters and histograms of
    `values`, and its families with labels of their own (their label values in the family's label order)."""
    for gauge, value in gauges.items():
        series.setdefault(gauge, []).append(prefixes[P + gauge, labels, ""] + number(value) + "\n")
    for counter, value in values.counters.items():
        series.setdefault(counter, []).append(prefixes[P + counter, labels, ""] + number(value) + "\n")
    for histogram_name, histogram in values.histograms.items():
        last = prefixes.histogram_lines.get((histogram_name, labels))
        if last is not None and last[0] is histogram:
            series.setdefault(histogram_name, []).append(last[1])
            continue
        bounds, counts = zip(*histogram.buckets)
        numbers = (*counts, histogram.count, histogram.sum)
        template = prefixes.histogram(histogram_name, labels, bounds)
        if math.isfinite(sum(numbers)):  # %r writes a finite float as number() does
            text = template % numbers
        else:
            text = template % tuple(_Spelled(v) for v in numbers)
        prefixes.histogram_lines[histogram_name, labels] = histogram, text
        series.setdefault(histogram_name, []).append(text)
    for family, by_labels in labelled.items():
        names = contract.FAMILIES[family].labels
        for label_values, value in by_labels.items():
            extra = "".join(f',{label}="{_escape(v)}"' for label, v in zip(names, label_values))
            series.setdefault(family, []).append(prefixes[P + family, labels, extra] + number(value) + "\n")


_LE: dict[float, str] = {}


def _le(bound: float) -> str:
    """The `le` label of a bucket, in Go's spelling like every other exporter's (cached: buckets repeat)."""
    text = _LE.get(bound)
    if text is None:
        text = _LE[bound] = f',le="{floatToGoString(bound)}"'
    return text


def render(targets: Iterable[TargetText], now: float, staleness: float,
           exporter_lines: dict[str, str] | None = None, hidden: frozenset[str] = frozenset()) -> list[bytes]:
    """The exposition of these targets, as the parts to send one after the other (joined, a scrape of
    2,000 targets would copy 30 to 40 MB once more); values older than `staleness` seconds are left
    out, never frozen; the `hidden` families (of groups the configuration turned off) never shown."""
    shown = _shown(targets, now, staleness)
    parts: list[bytes] = []
    for key, header in HEADERS.items():
        if key in hidden:
            continue
        chunks = [exporter_lines[key].encode()] if exporter_lines and key in exporter_lines else []
        chunks += _chunks(key, shown)
        if chunks:
            parts.append(header)
            parts.extend(chunks)
    return parts


def families(targets: Iterable[TargetText], now: float, staleness: float) -> dict[str, bytes]:
    """These targets' lines as `render` shows them, joined by family and without headers: a worker
    process's share of the page (exporter/runtime/workers.py)."""
    shown = _shown(targets, now, staleness)
    joined = {key: b"".join(_chunks(key, shown)) for key in HEADERS}
    return {key: text for key, text in joined.items() if text}


def _shown(targets: Iterable[TargetText], now: float, staleness: float) -> list[tuple[TargetText, bool]]:
    return [(t, t.last_success is not None and now - t.last_success <= staleness) for t in targets]


def _chunks(key: str, shown: list[tuple[TargetText, bool]]) -> list[bytes]:
    chunks = []
    for target, fresh in shown:
        chunk = target.status.get(key) or (target.series.get(key) if fresh else None)
        if chunk:
            chunks.append(chunk)
    return chunks
