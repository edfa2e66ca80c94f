"""A KV event stream closes, and so lets its process exit, when its engine stops with it (the case that hung
the exporter: libzmq's I/O thread blocked on the monitor of a stream whose reader had already gone,
exporter/runtime/subscriber.py, EventStream._rejoin)."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import zmq
import zmq.asyncio

from devtools import harness
from devtools import kvevents_wire as wire
from devtools.harness import Publisher


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
