"""A worker process of an exporter with `workers:` above 1 (exporter/runtime/workers.py): polls the
targets of its shard and answers its parent's requests, read from stdin, on stdout.

    python -m kvcache_exporter.runtime.worker INDEX COUNT   (started by the parent, never by hand)
"""

from __future__ import annotations

import os
import signal
import sys
import time

from .. import exposition
from . import collector, logs, process_series
from .shard import Shard, polled_by
from .workers import read_frame, write_frame


def answer(shard: Shard, index: int, kind: str, payload):
    """The answer to one of the parent's requests (exporter/runtime/workers.py, Workers._ask)."""
    if kind == "scrape":
        texts = shard.scheduler.run(_observed(shard, payload))
        # Joined here, outside the poll loop: the parent only puts the workers' families side by side.
        families = exposition.families(texts, time.time(), shard.config.staleness)
        families.update((name, text.encode()) for name, text in process_series.lines(worker=index).items())
        return families, shard.scheduler.phase_state()
    if kind == "ready":
        return shard.readiness()
    shard.apply(payload)  # "config": a reload
    return True


async def _observed(shard: Shard, seen: tuple[str, float, bool] | None) -> list[exposition.TargetText]:
    """The scrape seen by the worker's poll loop as the parent saw it (CLOCK_MONOTONIC is the machine's,
    the same in every process), and the shard's texts; in the loop."""
    if seen is not None:
        shard.scheduler.scrapes.observe(*seen)
    return shard.texts()


def main(argv: list[str]) -> int:
    index, count = int(argv[0]), int(argv[1])
    # The parent decides when its workers stop (they end with their stdin, whatever ends the parent), and
    # signals meant for it reach them too: Ctrl-C the terminal's process group, systemd's stop the whole
    # cgroup, `pkill -HUP -f kvcache_exporter` for a reload every process whose command line matches.
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    requests, answers = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # nothing but answers may go down the parent's pipe
    first = read_frame(requests)
    if first is None:
        return 0
    ident, _, config = first
    logs.configure(config.log_level, config.log_format, worker=index)
    shard = Shard(config, polled_by(config, index, count))
    shard.start()
    collector.tune()
    write_frame(answers, (ident, True))
    try:
        while (request := read_frame(requests)) is not None:
            ident, kind, payload = request
            write_frame(answers, (ident, answer(shard, index, kind, payload)))
    except BrokenPipeError:  # the parent is gone
        pass
    finally:
        shard.scheduler.run(shard.close())
        shard.stop()
    return 0


if __name__ == "__main__":
    status = main(sys.argv[1:])
    # Its streams and connections are closed: the interpreter's teardown (0.15 to 0.3 s of module cleanup on a busy
    # machine) would only hold up the parent's stop, which waits for this process.
    sys.stderr.flush()
    os._exit(status)
