"""The rich rendering of `top`: the live screen, laid out for the terminal's size at every refresh,
and the plain table of `--once`."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from rich.console import Console, ConsoleOptions, Group, RenderResult
from rich.table import Table
from rich.text import Text

from ..thresholds import DEFAULT as THRESHOLDS
from ..units import format_duration
from .rows import SORTS, STATES, USAGE_BAR_WIDTH, Column, count, filter_rows, fit, per_min, percent, sort_rows, totals
from .source import Frame

STATE_STYLE = {"ok": "green", "tight": "yellow", "capped": "magenta", "saturated": "bold red",
               "thrashing": "bold white on red"}


def _usage_bar(row: dict) -> Text:
    usage = row["usage_ratio"]
    if usage is None:
        return Text("-")
    style = ("red" if usage >= THRESHOLDS.high_water_ratio else "yellow" if usage >= THRESHOLDS.low_water_ratio
             else "green")
    filled = min(USAGE_BAR_WIDTH, max(0, round(usage * USAGE_BAR_WIDTH)))
    return Text.assemble(("█" * filled, style), ("░" * (USAGE_BAR_WIDTH - filled), "dim"), f" {percent(usage):>4}")


def table(rows: list[dict], layout: list[tuple[Column, int]], styled: bool) -> Table:
    grid = Table(box=None, padding=(0, 1, 0, 0), pad_edge=False, show_edge=False, expand=False,
                 header_style="bold reverse" if styled else "")
    for column, width in layout:
        grid.add_column(column.header, width=width, justify=column.justify, no_wrap=True, overflow="ellipsis")
    for row in rows:
        cells: list[Any] = []
        for column, _ in layout:
            if styled and column.name == "usage":
                cells.append(_usage_bar(row))
            elif styled and column.name == "state":
                cells.append(Text(column.text(row), STATE_STYLE.get(row["state"] or "", "")))
            else:
                cells.append(column.text(row))
        grid.add_row(*cells)
    return grid


def window(fleet: dict[str, Any]) -> str:
    """The window of the per-minute figures, the pressure state's, and while the reads cover less of it so far
    (a pool's first minute), how much: a thrashing pool's rate is the one that made it thrashing only over
    the whole window."""
    whole, covered = fleet["window_seconds"], fleet["rates_seconds"]
    if covered is not None and covered >= whole:
        return f"window {format_duration(whole)}"
    return f"window {covered or 0:.0f}s of {format_duration(whole)}"


def summary(fleet: dict[str, Any], styled: bool) -> list[Text]:
    """The fleet's KV, its requests, its pools per state and the window of the per-minute figures: three lines
    of at most 80 columns."""
    kv = Text(f"pools {fleet['pools']}  targets up {fleet['targets_up']}/{fleet['targets']}  "
              f"KV {percent(fleet['usage_ratio'])} used, {count(fleet['free_tokens'])} of "
              f"{count(fleet['capacity_tokens'])} tokens free")
    requests = Text(f"running {count(fleet['requests_running'])}  waiting for KV "
                    f"{count(fleet['requests_waiting_for_kv'])}, with KV room "
                    f"{count(fleet['requests_waiting_with_kv_room'])}  preemptions/min "
                    f"{per_min(fleet['preemptions_per_min'])}")
    states = Text()
    for state in reversed(STATES):
        pools = fleet["states"][state]
        states.append(f"{state} {pools}", STATE_STYLE[state] if styled and pools else "")
        states.append("  ")
    states.append(window(fleet), "dim" if styled else "")
    return [kv, requests, states]


def plain(fleet: dict[str, Any], rows: list[dict]) -> str:
    """The `--once` output: the fleet lines and every column, no colour."""
    console = Console(width=10_000, color_system=None, force_terminal=False, record=False, highlight=False)
    with console.capture() as captured:
        for line in summary(fleet, styled=False):
            console.print(line)
        console.print()
        console.print(table(rows, fit(rows, None, bar=False, window_seconds=fleet["window_seconds"]), styled=False))
    return "\n".join(line.rstrip() for line in captured.get().splitlines()) + "\n"


@dataclass
class ViewState:
    """What the operator chose and what the last read gave; the live screen renders it."""

    source: str
    window_seconds: float  # of the per-minute figures: the pressure state's (the source's thresholds)
    sort: str = "state"
    filter: str = ""
    editing: str | None = None  # the filter being typed after `/`
    paused: bool = False
    frame: Frame | None = None
    rows: list[dict] | None = None
    error: str | None = None

    def cycle_sort(self) -> None:
        self.sort = SORTS[(SORTS.index(self.sort) + 1) % len(SORTS)]


class Screen:
    """The live screen, laid out anew at every refresh for the terminal's current size."""

    def __init__(self, state: ViewState):
        self.state = state

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        state = self.state
        width, height = options.max_width, options.height or console.height
        title = Text(f"kvcache-exporter top  {state.source}", style="bold")
        if state.frame is not None:
            title.append(time.strftime("  %H:%M:%S", time.localtime(state.frame.read_at)))
        if state.paused:
            title.append("  PAUSED", style="bold reverse")
        lines: list[Any] = [title]
        rows = state.rows or []
        if state.error:
            lines.append(Text(state.error, style="bold red"))
        if state.frame is not None:
            lines.extend(summary(totals(state.frame, rows, state.window_seconds), styled=True))
        shown = sort_rows(filter_rows(rows, state.filter), state.sort)
        room = max(0, height - len(lines) - 3)  # the table's two header lines and the footer
        layout = fit(shown, width, bar=True, window_seconds=state.window_seconds)
        lines.append(table(shown[:room], layout, styled=True))
        lines.append(self._footer(len(shown) - room))
        for line in lines:
            if isinstance(line, Text):
                line.no_wrap, line.overflow = True, "crop"
        yield Group(*lines)

    def _footer(self, hidden: int) -> Text:
        state = self.state
        if state.editing is not None:
            return Text.assemble(("filter: ", "bold"), state.editing, ("_", "blink"), "   Enter apply, Esc cancel")
        footer = Text.assemble(("q", "bold"), " quit  ", ("s", "bold"), f" sort: {state.sort}  ",
                               ("/", "bold"), " filter", f": {state.filter}" if state.filter else "", "  ",
                               ("p", "bold"), " resume" if state.paused else " pause")
        if hidden > 0:
            footer.append(f"  (+{hidden} more)")
        return footer
