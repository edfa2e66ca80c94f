"""The interactive screen: reads in a background thread, keys and redraws in the main one.

Keys come from the terminal in cbreak mode (stdlib termios); drawing, the alternate screen and
colours are rich's. The screen is laid out again at every redraw, so a resized terminal gets a
layout for its new size within one redraw.
"""

from __future__ import annotations

import os
import select
import signal
import sys
import termios
import threading
import time
import tty

from rich.console import Console
from rich.live import Live

from ..sources import parser
from .rates import RateWindow
from .rows import build_rows
from .screen import Screen, ViewState
from .source import SourceError, read_frame

REDRAW_SECONDS = 0.25
ESCAPE, BACKSPACES, ENTERS = "\x1b", ("\x7f", "\b"), ("\r", "\n")


class Reader(threading.Thread):
    """Reads the source every `interval` seconds; `latest` is the newest (frame, rows, error)."""

    def __init__(self, source, interval: float):
        super().__init__(name="top-reader", daemon=True)
        self.source, self.interval = source, interval
        self.window = RateWindow(source.thresholds.window_seconds)
        self.stop = threading.Event()
        self.latest: tuple | None = None

    def run(self) -> None:
        try:
            while not self.stop.is_set():
                try:
                    frame = read_frame(self.source.read(), time.time())
                    thresholds = frame.thresholds_or(self.source.thresholds)
                    self.window.window = thresholds.window_seconds
                    self.window.add(frame)
                    self.latest = (frame, build_rows(frame, self.window, thresholds), None)
                except (SourceError, parser.ParseError) as err:
                    # Nothing from before is shown as if it were current.
                    self.latest = (None, [], f"read failed at {time.strftime('%H:%M:%S')}: {err}")
                except Exception as err:  # a bug must show on the screen, never freeze it on old values
                    self.latest = (None, [], f"read failed at {time.strftime('%H:%M:%S')}: unexpected {err!r}")
                self.stop.wait(self.interval)
        finally:
            self.source.close()


class Keys:
    """The terminal in cbreak mode while the screen runs: keys arrive one by one, unechoed."""

    def __enter__(self) -> "Keys":
        self.fd = sys.stdin.fileno()
        self.saved = termios.tcgetattr(self.fd)
        tty.setcbreak(self.fd)
        return self

    def __exit__(self, *exc) -> None:
        termios.tcsetattr(self.fd, termios.TCSADRAIN, self.saved)

    def read(self, timeout: float) -> str:
        ready, _, _ = select.select([self.fd], [], [], timeout)
        return os.read(self.fd, 64).decode("utf-8", errors="ignore") if ready else ""


def handle(state: ViewState, keys: str) -> bool:
    """Apply what was typed; False when the operator quits."""
    if keys.startswith(ESCAPE) and len(keys) > 1:
        return True  # an arrow or function key: not ours
    for key in keys:
        if state.editing is not None:
            if key in ENTERS:
                state.filter, state.editing = state.editing, None
            elif key == ESCAPE:
                state.editing = None
            elif key in BACKSPACES:
                state.editing = state.editing[:-1]
            elif key.isprintable():
                state.editing += key
        elif key == "q":
            return False
        elif key == "s":
            state.cycle_sort()
        elif key == "/":
            state.editing = ""
        elif key == "p":
            state.paused = not state.paused
        elif key == ESCAPE:
            state.filter = ""
    return True


def run(source, interval: float, state: ViewState) -> int:
    # COLUMNS and LINES, where a shell exported them, froze the size the terminal had at start; rich
    # would keep them over the terminal's own size and never follow a resize.
    for name in ("COLUMNS", "LINES"):
        os.environ.pop(name, None)
    reader = Reader(source, interval)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    reader.start()
    try:
        with Keys() as keys, Live(Screen(state), console=Console(), screen=True, auto_refresh=False) as live:
            while not stop.is_set():
                if not state.paused and reader.latest is not None:
                    state.frame, state.rows, state.error = reader.latest
                    state.window_seconds = reader.window.window
                live.refresh()
                if not handle(state, keys.read(REDRAW_SECONDS)):
                    break
    except KeyboardInterrupt:
        pass
    finally:
        reader.stop.set()
        reader.join(timeout=5)
    return 0
