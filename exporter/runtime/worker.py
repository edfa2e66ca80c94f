"""A worker process of an exporter with `workers:` above 1 (exporter/runtime/workers.py): polls the
targets of its shard and answers its parent's requests, read from stdin, on stdout.

    python -m kvcache_exporter.runtime.worker INDEX COUNT   (started by the parent, never by hand)
"""

from __future__ import annotations

import logging
import signal
import sys
import time

from .. import exposition
from ..config import Config
from .shard import Shard, shard_of
from .workers import read_frame, write_frame

log = logging.getLogger(__name__)


class _Worker:
    def __init__(self, config: Config, index: int, count: int):
        self.shard = Shard(config, lambda name: shard_of(name, count) == index)

    def answer(self, kind: str, payload):
        shard = self.shard
        if kind == "scrape":
            client, arrived, prometheus = payload
            texts = shard.scheduler.run(self._observe(client, arrived, prometheus))
            # Joined here, outside the poll loop: the parent only puts the workers' families side by side.
            families = exposition.families(texts, time.time(), shard.config.staleness)
            return families, shard.scheduler.phase_state()
        if kind == "ready":
            return shard.readiness()
        if kind == "config":
            shard.apply(payload)
            return True
        raise ValueError(f"unknown request {kind!r}")

    async def _observe(self, client: str, arrived: float, prometheus: bool):
        # The parent's arrival time: CLOCK_MONOTONIC is the machine's, the same in every process.
        self.shard.scheduler.scrapes.observe(client, arrived, prometheus)
        return self.shard.texts()


def main(argv: list[str]) -> int:
    index, count = int(argv[0]), int(argv[1])
    # Ctrl-C in a terminal reaches the whole process group: the parent decides when its workers stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    requests, answers = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # nothing but answers may go down the parent's pipe
    first = read_frame(requests)
    if first is None:
        return 0
    ident, _, config = first
    logging.basicConfig(level=config.log_level.upper(),
                        format=f"%(asctime)s %(levelname)s worker-{index} %(name)s: %(message)s")
    worker = _Worker(config, index, count)
    worker.shard.start()
    write_frame(answers, (ident, True))
    try:
        while (request := read_frame(requests)) is not None:
            ident, kind, payload = request
            write_frame(answers, (ident, worker.answer(kind, payload)))
    except BrokenPipeError:  # the parent is gone
        pass
    finally:
        worker.shard.scheduler.run(worker.shard.close())
        worker.shard.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
