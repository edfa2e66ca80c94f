"""A KV event publisher on loopback that behaves like the engines' ZmqEventPublisher: PUB socket, 8-byte
big-endian sequence numbers, and a ROUTER replay endpoint answering `[b"", start_seq]` with the buffered
batches from start_seq on, then the end marker: `[topic, seq, payload]` as vLLM since v0.26, or
`[seq, payload]` as SGLang and older vLLM (`replay_topic=False`)."""

from __future__ import annotations

import threading
from collections import deque

import zmq

END_SEQ = (-1).to_bytes(8, "big", signed=True)


class Publisher:
    def __init__(self, pub_port: int, replay_port: int | None = None, topic: bytes = b"", buffer_steps: int = 10_000,
                 replay_topic: bool = True):
        self.topic = topic
        self._reply_head = [topic] if replay_topic else []
        self.seq = 0
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._context = zmq.Context()
        self.pub = self._context.socket(zmq.PUB)
        self.pub.setsockopt(zmq.SNDHWM, 100_000)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.bind(f"tcp://127.0.0.1:{pub_port}")
        self.replays = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = None
        if replay_port is not None:
            self.router = self._context.socket(zmq.ROUTER)
            self.router.setsockopt(zmq.LINGER, 0)
            self.router.bind(f"tcp://127.0.0.1:{replay_port}")
            self._thread = threading.Thread(target=self._serve_replay, daemon=True)
            self._thread.start()

    def send(self, payload: bytes, seq: int | None = None, publish: bool = True) -> int:
        """Publish one batch (or only buffer it for replay: a message the subscriber never got)."""
        seq = self.seq if seq is None else seq
        self.seq = seq + 1
        with self._lock:
            self.buffer.append((seq, payload))
        if publish:
            self.pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])
        return seq

    def send_frames(self, frames: list[bytes]) -> None:
        self.pub.send_multipart(frames)

    def _serve_replay(self) -> None:
        while not self._stop.is_set():
            if not self.router.poll(50):
                continue
            frames = self.router.recv_multipart()
            if len(frames) != 3:
                continue
            client, _, start = frames
            start_seq = int.from_bytes(start, "big")
            self.replays += 1
            with self._lock:
                buffered = [(seq, payload) for seq, payload in self.buffer if seq >= start_seq]
            for seq, payload in buffered:
                self.router.send_multipart([client, b"", *self._reply_head, seq.to_bytes(8, "big"), payload])
            self.router.send_multipart([client, b"", *([b""] if self._reply_head else []), END_SEQ, b""])

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self.router.close()
        self.pub.close()
        self._context.term()

    def __enter__(self) -> "Publisher":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
