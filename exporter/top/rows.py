"""The rows `top` shows: one per pool with its figures, the fleet totals, and the columns: how a
value is written, how it sorts (worst first), how long it stays when the terminal is narrow.

Rows are plain dicts and `--json` prints them as they are; nothing here needs a terminal library.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Callable

from .. import contract
from ..thresholds import DEFAULT as DEFAULT_THRESHOLDS
from ..thresholds import Thresholds
from ..units import format_duration
from .rates import RateWindow
from .source import CAPACITY_MISSES, Frame

STATES = contract.PRESSURE_STATES  # mildest first
TOP_HOLDERS = 3  # adapters and tenants --json lists per pool, most resident blocks first
TARGET_MIN_WIDTH = 8
USAGE_BAR_WIDTH = 8


def build_rows(frame: Frame, window: RateWindow, thresholds: Thresholds = DEFAULT_THRESHOLDS) -> list[dict[str, Any]]:
    """One dict per pool, in page order; a value the exporter does not give is None. `why` says the state's
    reason in the words of contract.PRESSURE_REASONS, with the pool's numbers and the source's marks."""
    rows = []
    for key, pool in frame.pools.items():
        gauges = pool.gauges
        rates = window.rates(key)
        rows.append({
            "target": pool.target, "engine": pool.engine, "model": pool.model, "dp_rank": pool.dp_rank,
            "role": pool.role, "state": pool.state,
            "usage_ratio": gauges.get("usage_ratio"),
            "capacity_tokens": gauges.get("capacity_tokens"),
            "free_tokens": gauges.get("free_tokens"),
            "headroom_requests": gauges.get("headroom_requests"),
            "live_tokens_per_request": gauges.get("live_tokens_per_request"),
            "requests_running": gauges.get("requests_running"),
            "requests_running_max": gauges.get("requests_running_max"),
            "requests_waiting": gauges.get("requests_waiting"),
            "requests_waiting_for_kv": gauges.get("requests_waiting_for_kv"),
            "requests_waiting_with_kv_room": gauges.get("requests_waiting_with_kv_room"),
            "preemptions_per_min": rates.preemptions_per_min,
            "prefix_hit_ratio": rates.prefix_hit_ratio,
            "ttft_p90_seconds": rates.ttft_p90_seconds,
            "rates_seconds": rates.seconds,
            "polled_at": pool.at,
            "reason": pool.reason,
        })
        rows[-1]["why"] = why(rows[-1], thresholds)
        if CAPACITY_MISSES in pool.counters:  # the key exists only where the exporter has the series
            rows[-1]["capacity_misses_per_min"] = rates.capacity_misses_per_min
        if pool.holders:  # the pool's KV event stream names who holds its blocks
            rows[-1]["top_holders"] = {
                holder: [[name, blocks] for name, blocks in sorted(by.items(), key=lambda item: -item[1])[:TOP_HOLDERS]]
                for holder, by in pool.holders.items()}
    return rows


def totals(frame: Frame, rows: list[dict[str, Any]], window_seconds: float) -> dict[str, Any]:
    """Fleet sums (of what can be summed: tokens, requests, per-minute rates), pools per state, the window of
    the per-minute figures and how much of it the reads cover so far (the shortest of any pool's)."""
    def total(name: str) -> float | None:
        values = [row[name] for row in rows if row[name] is not None]
        return sum(values) if values else None

    capacity, free = total("capacity_tokens"), total("free_tokens")
    states = {state: sum(row["state"] == state for row in rows) for state in STATES}
    covered = [row["rates_seconds"] for row in rows if row["rates_seconds"] is not None]
    return {
        "pools": len(rows),
        "targets": len(frame.targets_up),
        "targets_up": sum(frame.targets_up.values()),
        "capacity_tokens": capacity,
        "free_tokens": free,
        "usage_ratio": (capacity - free) / capacity if capacity and free is not None else None,
        "requests_running": total("requests_running"),
        "requests_waiting_for_kv": total("requests_waiting_for_kv"),
        "requests_waiting_with_kv_room": total("requests_waiting_with_kv_room"),
        "preemptions_per_min": total("preemptions_per_min"),
        "states": states,
        "window_seconds": window_seconds,
        "rates_seconds": min(covered, default=None),
    }


def why(row: dict[str, Any], thresholds: Thresholds) -> str | None:
    """The pool's reason as text (contract.reason_text), None where the exporter gives none or the pool is ok."""
    reason = row["reason"]
    if reason is None or contract.PRESSURE_REASONS[reason].state == "ok":
        return None
    given = {"low_water_ratio": thresholds.low_water_ratio, "high_water_ratio": thresholds.high_water_ratio,
             "preemptions_per_minute": row["preemptions_per_min"]}

    def value(name: str) -> str:
        number = given[name] if name in given else row[name]
        if name in contract.REASON_RATIOS:
            return percent(number)
        if name == "headroom_requests":
            return _whole(number)
        return per_min(number) if name == "preemptions_per_minute" else count(number)

    return contract.reason_text(reason, value)


# -- how values are written -------------------------------------------------------------------

def count(value: float | None) -> str:
    if value is None:
        return "-"
    for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= scale:
            return f"{value / scale:.3g}{suffix}"
    return f"{value:.0f}" if value == int(value) else f"{value:.1f}"


def per_min(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.1f}" if value < 100 else count(round(value))


def _seconds(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value * 1000:.0f}ms" if value < 1 else f"{value:.3g}s" if value < 1000 else f"{value:.0f}s"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def percent(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:.0f}%"


def _whole(value: float | None) -> str:
    """Whole requests: 0.6 of a typical request does not fit one."""
    return "-" if value is None else count(math.floor(value))


def _running(row: dict) -> str:
    running, cap = row["requests_running"], row["requests_running_max"]
    return count(running) if cap is None or running is None else f"{count(running)}/{count(cap)}"


def _severity(state: str | None) -> int:
    return STATES.index(state) if state in STATES else -1


def _low_first(value: float | None) -> float:
    return math.inf if value is None else value


def _high_first(value: float | None) -> float:
    return math.inf if value is None else -value


@dataclass(frozen=True)
class Column:
    name: str  # also the sort name (`s`, --sort)
    header: str
    text: Callable[[dict], str]
    worst_first: Callable[[dict], Any]  # sort key: the worst row sorts first
    keep: int  # when the terminal is narrow, the column with the lowest `keep` goes first
    justify: str = "right"
    min_width: int = 0


COLUMNS = (
    Column("target", "TARGET", lambda r: r["target"], lambda r: r["target"], 100, "left"),
    Column("dp", "DP", lambda r: r["dp_rank"], lambda r: r["dp_rank"], 40, "left"),
    # Disaggregated prefill/decode: shown where a pool is not unified.
    Column("role", "ROLE", lambda r: r["role"], lambda r: r["role"], 45, "left"),
    Column("engine", "ENGINE", lambda r: r["engine"], lambda r: r["engine"], 20, "left"),
    Column("model", "MODEL", lambda r: r["model"], lambda r: r["model"], 10, "left"),
    Column("state", "STATE", lambda r: r["state"] or "-",
           lambda r: (-_severity(r["state"]), _high_first(r["usage_ratio"])), 99, "left", max(map(len, STATES))),
    Column("usage", "KV USED", lambda r: percent(r["usage_ratio"]), lambda r: _high_first(r["usage_ratio"]), 98),
    Column("free", "FREE\nTOKENS", lambda r: count(r["free_tokens"]), lambda r: _low_first(r["free_tokens"]), 90),
    Column("headroom", "HEAD\nROOM", lambda r: _whole(r["headroom_requests"]),
           lambda r: _low_first(r["headroom_requests"]), 95),
    Column("running", "RUN", _running, lambda r: _high_first(r["requests_running"]), 50),
    Column("waiting-kv", "WAIT\nKV", lambda r: count(r["requests_waiting_for_kv"]),
           lambda r: _high_first(r["requests_waiting_for_kv"]), 97),
    Column("waiting-room", "WAIT\nROOM", lambda r: count(r["requests_waiting_with_kv_room"]),
           lambda r: _high_first(r["requests_waiting_with_kv_room"]), 96),
    Column("preempt", "PREEMPT\n/min {window}", lambda r: per_min(r["preemptions_per_min"]),
           lambda r: _high_first(r["preemptions_per_min"]), 89),
    # Prompt tokens served from any cache, the GPU pool's or beyond it, over those looked up (rates._prefix).
    Column("hit", "HIT\n{window}", lambda r: _ratio(r["prefix_hit_ratio"]), lambda r: _low_first(r["prefix_hit_ratio"]),
           60),
    Column("ttft", "TTFT\np90 {window}", lambda r: _seconds(r["ttft_p90_seconds"]),
           lambda r: _high_first(r["ttft_p90_seconds"]), 88),
    Column("misses", "MISSES\n/min {window}", lambda r: per_min(r.get("capacity_misses_per_min")),
           lambda r: _high_first(r.get("capacity_misses_per_min")), 70),
    # Last: the only column of words, cut first on a narrow terminal (the state still says which).
    Column("why", "WHY", lambda r: r["why"] or "", lambda r: (-_severity(r["state"]), _high_first(r["usage_ratio"])),
           5, "left"),
)
SORTS = tuple(column.name for column in COLUMNS if column.name not in ("dp", "role", "engine", "model"))
_BY_NAME = {column.name: column for column in COLUMNS}


def sort_rows(rows: list[dict], sort: str) -> list[dict]:
    """Worst first by the sort column; ties by severity, then by target and rank, so the order is stable."""
    tie = _BY_NAME["state"].worst_first
    return sorted(rows, key=lambda r: (_BY_NAME[sort].worst_first(r), tie(r), r["target"], r["dp_rank"]))


def filter_rows(rows: list[dict], text: str) -> list[dict]:
    """Rows whose target, engine, model, rank, role or state holds `text` (case-insensitive)."""
    needle = text.lower()
    return [r for r in rows if any(needle in (r[k] or "").lower()
                                   for k in ("target", "engine", "model", "dp_rank", "role", "state"))]


# -- layout -------------------------------------------------------------------------------------

def _natural_widths(columns: list[Column], rows: list[dict]) -> dict[str, int]:
    widths = {}
    for column in columns:
        cells = [len(column.text(row)) for row in rows]
        widths[column.name] = max([column.min_width] + [len(line) for line in column.header.split("\n")] + cells)
    return widths


def fit(rows: list[dict], width: int | None, bar: bool, window_seconds: float) -> list[tuple[Column, int]]:
    """The columns to show, their headers naming the window of the per-minute figures, and their widths: every
    column when `width` is None, else the most
    important ones that fit in `width` (one space between columns); the misses column only where the
    exporter has capacity misses, the role column only where a pool is not unified. The target column is cut
    (with an ellipsis) before anything is dropped."""
    shown = {"misses": any("capacity_misses_per_min" in r for r in rows),
             "role": any(r["role"] not in ("unified", "") for r in rows)}
    window = format_duration(window_seconds)
    columns = [replace(c, header=c.header.format(window=window)) for c in COLUMNS if shown.get(c.name, True)]
    widths = _natural_widths(columns, rows)
    if bar:
        widths["usage"] = USAGE_BAR_WIDTH + 5
    if width is None:
        return [(column, widths[column.name]) for column in columns]
    natural_target = widths["target"]
    widths["target"] = min(natural_target, TARGET_MIN_WIDTH)

    def used(shown: list[Column]) -> int:
        return sum(widths[c.name] for c in shown) + len(shown) - 1

    while len(columns) > 1 and used(columns) > width:
        columns.remove(min(columns, key=lambda c: c.keep))
    widths["target"] = max(1, min(natural_target, widths["target"] + width - used(columns)))
    return [(column, widths[column.name]) for column in columns]


