"""An exporter with KV event subscriptions stops on SIGTERM or SIGINT within 2 s, every time: streams
flowing, a poll hanging on its target, with and without worker processes, beside an idle and a busy core,
and with the engines stopping at the same moment (the case that hung it: libzmq's I/O thread blocked on
the monitor of a stream whose reader had already gone, exporter/runtime/subscriber.py, EventStream._rejoin).
2 s is the bound the README's "at once" is held to (test_exporter_lifecycle.py), not a speed figure."""

from __future__ import annotations

import asyncio
import random
import signal
import subprocess
import sys
import threading
import time

import yaml
import zmq
import zmq.asyncio

from devtools import harness
from devtools import kvevents_wire as wire
from devtools.harness import PageServer, Publisher, hang_before_headers, page

CYCLES = 200  # stops: two exporters per cycle, half of the cycles beside a busy core
EXIT_BOUND = 2.0  # seconds from the signal to the process's exit
BUSY_SECONDS = 600  # the busy loop's own bound, should the test die before killing it
PAGE = harness.GOOD_PAGE


def close_a_stream_after_its_engine_went(monitor_reader_ended_first: bool) -> None:
    """In a process of its own (a blocked libzmq call holds the interpreter): join a publisher, let it go, so that
    the subscriber's connection drops (a monitored event), then close the stream and its context. With
    `monitor_reader_ended_first`, the task reading the monitor ends before the drop, as when the exporter's stop
    cancels it while the engine stops too."""
    from kvcache_exporter.config import KVEventsConfig
    from kvcache_exporter.runtime.subscriber import EventStream

    class Target:
        name = "engine"  # all a stream reads of its target before a render

    port = harness.free_port()
    publisher = Publisher(port)
    endpoint = f"tcp://127.0.0.1:{port}"

    async def run() -> None:
        context = zmq.asyncio.Context()
        stream = EventStream(Target(), 0, endpoint, None, KVEventsConfig(endpoint))
        stream.start(context)
        for _ in range(250):  # a PUB drops what it sends before the SUB has joined
            publisher.send(wire.batch("vllm-map", 1.0, []))
            await asyncio.sleep(0.02)
            if stream.messages:
                break
        assert stream.messages, "the stream never received a batch"
        if monitor_reader_ended_first:
            rejoin = next(task for task in stream._tasks if task.get_coro().__name__ == "_rejoin")
            rejoin.cancel()
            await asyncio.gather(rejoin, return_exceptions=True)
        publisher.close()
        await asyncio.sleep(0.3)  # libzmq's I/O thread has met the drop
        await stream.close()
        context.destroy(linger=0)

    asyncio.run(run())


def test_a_stream_closes_when_its_engine_went_after_the_monitors_reader_ended():
    for reader_ended_first in (True, False):
        code = ("from tests.e2e.test_kvevents_stop import close_a_stream_after_its_engine_went as close; "
                f"close({reader_ended_first})")
        result = subprocess.run([sys.executable, "-c", code], cwd=harness.REPO, capture_output=True, text=True,
                                timeout=15)
        assert result.returncode == 0, result.stderr


class Engines:
    """Two KV event publishers sending a batch every 10 ms from a thread, as engines under load do."""

    def __init__(self, page_url: str):
        self.page_url = page_url  # their /metrics
        self.ports = [harness.free_port() for _ in range(2)]
        self.publishers = [Publisher(port) for port in self.ports]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._publish, daemon=True)
        self._thread.start()

    def _publish(self) -> None:
        key = 0
        while not self._stop.wait(0.01):
            for publisher in self.publishers:
                key += 1
                publisher.send(wire.batch("vllm-map", time.time(), [wire.stored("vllm-map", [key])]))

    def stop(self) -> None:
        """The engines go: their connections drop."""
        if not self._stop.is_set():
            self._stop.set()
            self._thread.join()
            for publisher in self.publishers:
                publisher.close()


def start_exporter(tmp_path, name: str, engines: Engines, hanging_url: str, workers: int) -> harness.Process:
    targets = [{"name": f"engine-{i}", "url": engines.page_url, "kv_events": {"endpoint": f"tcp://127.0.0.1:{port}"}}
               for i, port in enumerate(engines.ports)]
    targets.append({"name": "hanging", "url": hanging_url})  # its poll waits 8 s for headers: always in flight
    config = tmp_path / f"{name}.yml"
    config.write_text(yaml.safe_dump({"poll_interval": "0.5s", "workers": workers, "targets": targets}))
    port = harness.free_port()
    return harness.Process(name, [sys.executable, "-m", "kvcache_exporter", "--listen", f"127.0.0.1:{port}",
                                  "--config", str(config)], tmp_path, f"http://127.0.0.1:{port}/healthz")


def test_every_stop_with_streams_workers_and_a_poll_in_flight_ends_within_two_seconds(tmp_path):
    """Two exporters per cycle (one with two workers), subscribed to the same two engines and stopped together."""
    rng = random.Random(45)
    slow, exits = [], []
    busy = None
    with PageServer({"/engine": page(PAGE), "/hang": hang_before_headers()}) as server:
        try:
            for cycle in range(CYCLES // 2):
                if cycle == CYCLES // 4:
                    busy = subprocess.Popen([sys.executable, "-c", "import time\nend = time.monotonic() + "
                                             f"{BUSY_SECONDS}\nwhile time.monotonic() < end: pass"])
                engines = Engines(server.url("/engine"))
                exporters = [start_exporter(tmp_path, f"exporter-{workers}", engines, server.url("/hang"), workers)
                             for workers in (1, 2)]
                try:
                    for exporter in exporters:
                        exporter.wait_ready()
                    time.sleep(rng.uniform(0.0, 0.6))
                    for exporter in exporters:
                        exporter.signal(signal.SIGINT if cycle % 5 == 0 else signal.SIGTERM)
                    if cycle % 3 == 0:  # the engines stop with the exporters: drops land while the streams close
                        time.sleep(rng.uniform(0.0, 0.05))
                        engines.stop()
                    signalled = time.monotonic()
                    for exporter in exporters:
                        try:
                            exporter.proc.wait(max(signalled + EXIT_BOUND - time.monotonic(), 0.0))
                        except subprocess.TimeoutExpired:
                            slow.append((cycle, exporter.name, busy is not None, exporter.log_tail(20)))
                        else:
                            assert exporter.proc.returncode == 0, exporter.log_tail()
                            exits.append(time.monotonic() - signalled)
                finally:
                    for exporter in exporters:
                        exporter.stop(timeout=10)
                    engines.stop()
        finally:
            if busy is not None:
                busy.kill()
                busy.wait()
    exits.sort()
    print(f"{len(exits)} stops within {EXIT_BOUND} s: median {exits[len(exits) // 2]:.2f} s, slowest {exits[-1]:.2f} s "
          "(from the signal to each exporter's exit)")
    assert not slow, f"{len(slow)} of {CYCLES} stops took over {EXIT_BOUND} s; the first: {slow[0]}"
