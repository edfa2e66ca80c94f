"""The worker processes of an exporter with `workers:` above 1, seen from the parent.

One process reads pages on one core at most (the GIL): at 2,000 engines the reading alone takes
1.4 to 1.8 s of every 5 s interval, so the polls locked to a scrape must start that long before it
and the data a scrape reads is up to that much older than a direct scrape's (docs/performance.md).
Workers split the targets by a hash of their names (shard.shard_of) and poll them in parallel; the
parent serves the HTTP endpoint (and /probe), asks every worker for its targets' lines at each
scrape, and joins them family by family.

Parent and worker talk over the worker's stdin and stdout (private pipes: nothing listens on a
port), one frame per message: 8 bytes of length, then a pickle of (request id, kind, payload).
A worker that ends is started again (counted); one that does not answer a request in time is left
out of that response (counted) and its late answer dropped, and one that has answered nothing for
the staleness period (its targets' series would be gone anyway) is killed and started again. A
worker whose parent is gone sees its stdin end and exits.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import pickle
import struct
import sys
import time
from typing import Any, BinaryIO

from .. import exposition
from ..config import Config
from .shard import Readiness

log = logging.getLogger(__name__)
_LENGTH = struct.Struct(">Q")
RESTART_DELAY = 1.0  # seconds before a worker that ended is started again: a crash loop costs little
RELOAD_TIMEOUT = 5.0  # seconds each worker has to take a reloaded configuration
# Seconds a stopping exporter gives a worker to end on its own before killing it: a worker ends in a tenth of
# that (its streams and connections closed), and the README promises a stop at once (within 2 s, tested).
STOP_GRACE = 1.0
READ_LIMIT = 1 << 20  # bytes buffered from a worker before its pipe is paused: fewer pauses for a large share
WORKER_MODULE = "kvcache_exporter.runtime.worker"


def encode(message: Any) -> bytes:
    """One frame, whole: the parent's requests, small, for an asyncio pipe."""
    body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return _LENGTH.pack(len(body)) + body


def write_frame(stream: BinaryIO, message: Any) -> None:
    """One message to a blocking stream (the worker's stdout): a share of a large fleet's page is tens of
    megabytes, written after its length rather than copied behind it."""
    body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_LENGTH.pack(len(body)))
    stream.write(body)
    stream.flush()


def read_frame(stream: BinaryIO) -> Any:
    """The next message from a blocking stream (the worker's stdin); None at its end."""
    head = stream.read(_LENGTH.size)
    if len(head) < _LENGTH.size:
        return None
    body = stream.read(_LENGTH.unpack(head)[0])
    return pickle.loads(body)


class _Worker:
    def __init__(self, index: int):
        self.index = index
        self.process: asyncio.subprocess.Process | None = None  # None until started, and while it starts again
        self.waiting: dict[int, asyncio.Future] = {}  # request id -> its answer
        self.silent_since: float | None = None  # monotonic time of the first request unanswered since its last answer
        self.answered = False  # whether the running process has answered (its first answer: its shard started)
        self.supervisor: asyncio.Task | None = None


class Workers:
    """Lives in the parent's event loop: every method runs there."""

    def __init__(self, count: int):
        self.count = count
        self.restarts = 0
        self.missed = 0
        self._workers = [_Worker(i) for i in range(count)]
        self._ids = itertools.count()
        self._config: Config | None = None
        self._stopping = False
        self._phases: list[tuple[float, bool]] = []  # each worker's (scrape interval, locked) at the last scrape

    async def start(self, config: Config) -> None:
        self._config = config
        for worker in self._workers:
            worker.supervisor = asyncio.create_task(self._supervise(worker))

    async def _supervise(self, worker: _Worker) -> None:
        """Run the worker, and again whenever it ends, until the exporter stops."""
        while True:
            try:
                process = await asyncio.create_subprocess_exec(
                    sys.executable, "-m", WORKER_MODULE, str(worker.index), str(self.count),
                    stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, limit=READ_LIMIT)
            except OSError as err:
                log.error("worker %d could not start: %s", worker.index, err)
            else:
                process.stdin.write(encode((next(self._ids), "config", self._config)))
                worker.process, worker.silent_since, worker.answered = process, None, False
                if self._stopping:  # started while the exporter stopped: end it with its input
                    process.stdin.close()
                await self._read_answers(worker, process)
                worker.process = None
                for future in worker.waiting.values():
                    future.cancel()
                worker.waiting.clear()
                status = await process.wait()
                if self._stopping:
                    return
                self.restarts += 1
                log.error("worker %d ended (exit status %s); starting it again", worker.index, status)
            await asyncio.sleep(RESTART_DELAY)
            if self._stopping:
                return

    async def _read_answers(self, worker: _Worker, process: asyncio.subprocess.Process) -> None:
        """Hand each answer to its request until the worker's stdout ends."""
        try:
            while True:
                head = await process.stdout.readexactly(_LENGTH.size)
                ident, answer = pickle.loads(await process.stdout.readexactly(_LENGTH.unpack(head)[0]))
                worker.silent_since, worker.answered = None, True
                future = worker.waiting.pop(ident, None)
                if future is not None and not future.done():
                    future.set_result(answer)
        except (asyncio.IncompleteReadError, ConnectionError):
            return

    async def _ask(self, kind: str, payload: Any, timeout: float) -> list[Any]:
        """Every worker's answer, None where it gave none within `timeout` seconds (or is starting again)."""
        loop = asyncio.get_running_loop()
        now = time.monotonic()
        asked: list[tuple[_Worker, int, asyncio.Future] | None] = []
        for worker in self._workers:
            process = worker.process
            if process is None or process.stdin.is_closing():
                asked.append(None)
                continue
            ident = next(self._ids)
            future = worker.waiting[ident] = loop.create_future()
            process.stdin.write(encode((ident, kind, payload)))
            asked.append((worker, ident, future))
        futures = [item[2] for item in asked if item is not None]
        if futures:
            await asyncio.wait(futures, timeout=timeout)
        answers = []
        for item in asked:
            if item is None:
                answers.append(None)
                continue
            worker, ident, future = item
            if future.done() and not future.cancelled():
                answers.append(future.result())
                continue
            worker.waiting.pop(ident, None)  # a late answer is dropped
            future.cancel()
            self.missed += 1
            answers.append(None)
            self._judge_silence(worker, now)
        return answers

    def _judge_silence(self, worker: _Worker, asked_at: float) -> None:
        """Kill a worker silent for the staleness period: its supervisor starts it again."""
        if worker.silent_since is None:
            worker.silent_since = asked_at
        silent = time.monotonic() - worker.silent_since
        if silent >= self._config.staleness and worker.process is not None and worker.process.returncode is None:
            log.error("worker %d answered nothing for %.1f s; killing it", worker.index, silent)
            worker.process.kill()

    async def scrape(self, seen: tuple[str, float, bool] | None, timeout: float) -> list[exposition.TargetText]:
        """Every worker's lines by family, as texts that always show (each worker left out what was stale).
        `seen`: (client, monotonic arrival, with Prometheus' timeout header) of a scrape the workers' clocks
        count, as phase.ScrapeClock.observe takes them; None for one they do not (a HEAD)."""
        answers = await self._ask("scrape", seen, timeout)
        self._phases = [answer[1] for answer in answers if answer is not None]
        return [exposition.TargetText(answer[0]) for answer in answers if answer is not None]

    def phase_state(self) -> tuple[float, bool, float]:
        """(scrape interval seen, every worker locked, the largest of their leads over the poll interval) as of
        the last scrape's answers."""
        phases = self._phases
        if not phases:
            return 0.0, False, 0.0
        return (phases[0][0], len(phases) == self.count and all(locked for _, locked, _ in phases),
                max(lead for _, _, lead in phases))

    async def readiness(self, timeout: float) -> list[Readiness | None]:
        return await self._ask("ready", None, timeout)

    async def apply(self, config: Config) -> None:
        """A reload: each worker keeps what it polls the same way (shard.Shard.apply); one starting again
        starts with it."""
        self._config = config
        await self._ask("config", config, timeout=RELOAD_TIMEOUT)

    async def close(self) -> None:
        """End every worker within STOP_GRACE: one that answered at the end of its input (it closes its streams
        and connections), one still starting at once (it holds nothing yet, and starting takes a second or more on
        a busy machine), one that outlives the grace by a kill."""
        self._stopping = True
        running = []
        for worker in self._workers:
            process = worker.process
            if process is None:
                continue
            if not worker.answered:
                process.kill()
            elif not process.stdin.is_closing():
                process.stdin.close()
            running.append(process)
        if running:
            waits = [asyncio.ensure_future(process.wait()) for process in running]
            _, late = await asyncio.wait(waits, timeout=STOP_GRACE)
            for process in running:
                if process.returncode is None:
                    process.kill()
            await asyncio.gather(*late)
        for worker in self._workers:
            if worker.supervisor is not None:  # waiting to start one again, or starting one
                worker.supervisor.cancel()
                await asyncio.gather(worker.supervisor, return_exceptions=True)
