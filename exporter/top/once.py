"""Not on a terminal, or with `--once` or `--json`: one table (or the rows as JSON), then exit."""

from __future__ import annotations

import json
import time

from .rates import RateWindow
from .rows import build_rows, filter_rows, sort_rows, totals
from .source import read_frame


def output(source, interval: float, sort: str, text_filter: str, as_json: bool) -> str:
    """Two reads, `interval` apart, so that the per-minute figures have a step; then the table, or the
    fleet and its rows as JSON. Closes the source; raises SourceError or parser.ParseError."""
    window = RateWindow(source.thresholds.window_seconds)
    try:
        for read in range(2):
            if read:
                time.sleep(interval)
            frame = read_frame(source.read(), time.time())
            thresholds = frame.thresholds_or(source.thresholds)
            window.window = thresholds.window_seconds
            window.add(frame)
    finally:
        source.close()
    every_pool = build_rows(frame, window, thresholds)
    rows = sort_rows(filter_rows(every_pool, text_filter), sort)
    fleet = totals(frame, every_pool, window.window)  # the filter narrows the table, never the fleet
    if as_json:
        return json.dumps({"fleet": fleet, "pools": rows}, indent=2) + "\n"
    from .screen import plain  # rich, an optional dependency that --json does without

    return plain(fleet, rows)
