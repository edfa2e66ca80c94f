"""A disaggregated prefill/decode proxy on loopback, for the real pair of tests/real/test_vllm_pd_pair.py.

Each completion goes to the prefill engine with max_tokens=1 and `kv_transfer_params` asking it to keep the
prompt's KV for a remote decode (NIXL's `do_remote_decode`), then to the decode engine with the parameters the
prefill engine answered (where its KV is: engine, host, port, block ids), which pulls it and generates. This is
the logic of vLLM's own disaggregated-serving example proxy. Every request's answers are kept as the pair's
ground truth: the prompt tokens, the blocks the prefill engine holds for it, the status of each step. A gate, where
given, holds the decode requests back (a decode side slow to pull): the prefill engine keeps their KV meanwhile.
"""

from __future__ import annotations

import contextlib
import json
import threading
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Iterator

from devtools import harness

# What a prefill engine is asked for: compute the prompt, keep its KV until a decode engine has pulled it.
REMOTE_DECODE = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                 "remote_block_ids": None, "remote_host": None, "remote_port": None}


@dataclass(frozen=True)
class Handed:
    """One request through the pair: what each engine answered."""
    prefill_status: int
    decode_status: int = 0
    prompt_tokens: int = 0  # the decode engine's count (the prefill engine's is the same prompt)
    remote_blocks: int = 0  # the KV blocks the prefill engine holds for the decode engine to pull
    completion_tokens: int = 0


@dataclass(frozen=True)
class Prefilled:
    """A prefill engine's answer, before the decode request: the prompt tokens it computed, the blocks it holds."""
    prompt_tokens: int
    remote_blocks: int


@dataclass
class Proxy:
    url: str
    model: str
    handed: list[Handed] = field(default_factory=list)
    prefilled: list[Prefilled] = field(default_factory=list)  # grows as each prefill answers, gate or not


def _post(url: str, body: dict, timeout: float) -> tuple[int, dict]:
    call = urllib.request.Request(f"{url}/v1/completions", data=json.dumps(body).encode(),
                                  headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(call, timeout=timeout) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, {"error": err.read().decode(errors="replace")[:500]}


@contextlib.contextmanager
def serve(prefill_url: str, decode_url: str, model: str, timeout: float = 300.0,
          decode_gate: threading.Event | None = None) -> Iterator[Proxy]:
    """The proxy on a free loopback port until the context exits; `.handed` grows by one per request. With
    `decode_gate`, a request goes to the decode engine only once the gate is set."""
    lock = threading.Lock()
    proxy = Proxy("", model)

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 (http.server's name)
            request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            status, prefilled = _post(prefill_url, {**request, "max_tokens": 1, "stream": False,
                                                    "kv_transfer_params": REMOTE_DECODE}, timeout)
            if status != 200:
                self._answer(status, prefilled, Handed(status))
                return
            params = prefilled.get("kv_transfer_params") or {}
            blocks = sum(map(len, params.get("remote_block_ids") or []))
            with lock:
                proxy.prefilled.append(Prefilled(prefilled.get("usage", {}).get("prompt_tokens", 0), blocks))
            if decode_gate is not None:
                decode_gate.wait(timeout)
            status, decoded = _post(decode_url, {**request, "kv_transfer_params": params}, timeout)
            usage = decoded.get("usage", {})
            self._answer(status, decoded, Handed(200, status, usage.get("prompt_tokens", 0), blocks,
                                                 usage.get("completion_tokens", 0)))

        def _answer(self, status: int, body: dict, handed: Handed) -> None:
            with lock:
                proxy.handed.append(handed)
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", harness.free_port()), Handler)
    proxy.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield proxy
    finally:
        server.shutdown()
        server.server_close()
