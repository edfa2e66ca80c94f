"""The interpreter's cyclic garbage collector, tuned for a process that reads pages all day.

A poll allocates thousands of short-lived containers (a page's samples, its families' lines), nearly all freed
by reference counting the moment the poll ends. The default generation-0 threshold (700 net allocations) still
runs a collection every few polls, and the older generations' collections walk every object the exporter keeps
(each target's history and rendered lines): 16 % of the exporter's CPU at 500 SGLang targets, under 1 % with the
threshold below and what was built at start frozen out of the collections (`python -m bench.reading` prints the
reads' cost both ways)."""

from __future__ import annotations

import gc

GENERATION0_THRESHOLD = 50_000


def tune() -> None:
    """Collect cycles less often, and never walk what exists now (configuration, targets, modules)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(GENERATION0_THRESHOLD, *gc.get_threshold()[1:])
