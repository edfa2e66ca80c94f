"""What the poll loop's timetable costs per second of a locked fleet: the loop wakes when the next
poll is due (at most every LOCKED_BATCH), asks which targets are due and when the next one is.

    python -m bench.timetable [--targets 2000]

Simulated time (no sleeping): N targets on a 5 s interval locked to a scraper on the same interval,
the wake-ups the scheduler would make over 60 s, the CPU they took per simulated second.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass

from kvcache_exporter.runtime import phase
from kvcache_exporter.runtime.scheduler import LOCKED_BATCH, TICK

INTERVAL = 5.0
SECONDS = 60.0


@dataclass(frozen=True)
class _Config:
    name: str


class _Target:
    """Named as exporter.runtime.target.Target is: through its configuration."""

    def __init__(self, name: str):
        self.config = _Config(name)

    @property
    def name(self) -> str:
        return self.config.name


def locked_clock(start: float) -> phase.ScrapeClock:
    clock = phase.ScrapeClock()
    for k in range(phase.HISTORY):
        clock.observe("prometheus", start - (phase.HISTORY - k) * INTERVAL + 1.3, prometheus=True)
    clock.update(INTERVAL, start)
    return clock


def cost(targets: int) -> tuple[float, int, int]:
    """(µs of CPU per simulated second, wake-ups, polls started) over SECONDS."""
    clock = locked_clock(1000.0)
    timetable = phase.Timetable(clock)
    timetable.spread = 1.5
    fleet = [_Target(f"t-{i}") for i in range(targets)]
    now, end, wakes, polls = 1000.0, 1000.0 + SECONDS, 0, 0
    started = time.process_time()
    while now < end:
        due = timetable.due(fleet, now, now + LOCKED_BATCH, INTERVAL)
        for target in due:
            timetable.finished(target.name, 0.01)
        polls += len(due)
        wakes += 1
        now = max(min(timetable.earliest(), now + TICK), now + 0.001)
    return (time.process_time() - started) / SECONDS * 1e6, wakes, polls


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.timetable", description=__doc__.split("\n\n")[0])
    p.add_argument("--targets", default="100,500,2000", help="fleet sizes, comma-separated")
    args = p.parse_args(argv)
    print("| targets | wake-ups a second | polls a second | µs of CPU a second | µs per poll |")
    print("|---|---|---|---|---|")
    for size in map(int, args.targets.split(",")):
        micros, wakes, polls = cost(size)
        print(f"| {size:,} | {wakes / SECONDS:.0f} | {polls / SECONDS:.0f} | {micros:,.0f} | {micros * SECONDS / polls:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
