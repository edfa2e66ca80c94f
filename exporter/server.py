"""The exporter's own HTTP endpoint: routes, optional TLS and basic auth (webconfig)."""

from __future__ import annotations

import logging
import ssl
import threading
import zlib
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable
from urllib.parse import parse_qs, urlsplit

from .webconfig import WebConfig

log = logging.getLogger(__name__)


@dataclass
class Request:
    method: str
    path: str
    query: dict[str, list[str]]
    headers: dict[str, str]


@dataclass
class Response:
    status: int
    body: bytes | list[bytes]  # a list: parts sent one after the other, never joined whole
    content_type: str = "text/plain; charset=utf-8"
    headers: dict[str, str] = field(default_factory=dict)


Route = Callable[[Request], Response]


class MetricsServer:
    def __init__(self, listen: str, routes: dict[tuple[str, str], Route], web: WebConfig | None = None):
        host, _, port = listen.rpartition(":")
        handler = type("Handler", (_Handler,), {"routes": routes, "web": web or WebConfig()})
        self.httpd = _Server((host.strip("[]") or "0.0.0.0", int(port)), handler)
        self.httpd.tls = (web or WebConfig()).tls
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="http", daemon=True)

    @property
    def port(self) -> int:
        return self.httpd.server_address[1]

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    tls: ssl.SSLContext | None = None

    def finish_request(self, request, client_address) -> None:
        # The TLS handshake runs here, in the connection's own thread, so a slow or plain-HTTP
        # client cannot hold up the accept loop.
        if self.tls is not None:
            try:
                request.settimeout(10)
                request = self.tls.wrap_socket(request, server_side=True)
            except (ssl.SSLError, OSError) as err:
                log.debug("TLS handshake with %s failed: %s", client_address[0], err)
                request.close()
                return
        super().finish_request(request, client_address)

    def handle_error(self, request, client_address) -> None:
        log.debug("connection from %s ended with an error", client_address[0], exc_info=True)


# Parts are joined into blocks of about this size before a send or a compression call: a call per
# part (tens of thousands of small ones at 2,000 targets) would cost more than the copy.
BLOCK_BYTES = 256 * 1024


def _size(body: bytes | list[bytes]) -> int:
    return len(body) if isinstance(body, bytes) else sum(map(len, body))


def _blocks(body: bytes | list[bytes]):
    if isinstance(body, bytes):
        yield body
        return
    block: list[bytes] = []
    size = 0
    for part in body:
        block.append(part)
        size += len(part)
        if size >= BLOCK_BYTES:
            yield b"".join(block)
            block, size = [], 0
    if block:
        yield b"".join(block)


def _gzip(body: bytes | list[bytes]) -> list[bytes]:
    # Level 1: the label sets repeat line after line, so it still compresses 15 to 18 times, for half
    # of level 6's CPU (bench/render.py). zlib releases the GIL while it compresses.
    compressor = zlib.compressobj(1, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    compressed = [compressor.compress(block) for block in _blocks(body)]
    compressed.append(compressor.flush())
    return compressed


class _Handler(BaseHTTPRequestHandler):
    routes: dict[tuple[str, str], Route]
    web: WebConfig
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        self._dispatch("GET")

    def do_POST(self) -> None:  # noqa: N802
        self._dispatch("POST")

    def _dispatch(self, method: str) -> None:
        url = urlsplit(self.path)
        if not self.web.authorized(self.headers.get("Authorization")):
            self._send(Response(401, b"unauthorized\n", headers={"WWW-Authenticate": 'Basic realm="kvcache-exporter"'}))
            return
        route = self.routes.get((method, url.path))
        if route is None:
            known = any(path == url.path for _, path in self.routes)
            self._send(Response(405 if known else 404, b"method not allowed\n" if known else b"not found\n"))
            return
        request = Request(method, url.path, parse_qs(url.query), dict(self.headers.items()))
        try:
            response = route(request)
        except Exception:  # a bug in one route must not take the endpoint down
            log.exception("error serving %s", url.path)
            response = Response(500, b"internal error\n")
        if "gzip" in self.headers.get("Accept-Encoding", "") and _size(response.body) > 1024:
            response.body = _gzip(response.body)
            response.headers["Content-Encoding"] = "gzip"
        self._send(response)

    def _send(self, response: Response) -> None:
        self.send_response(response.status)
        self.send_header("Content-Type", response.content_type)
        for name, value in response.headers.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(_size(response.body)))
        self.end_headers()
        for block in _blocks(response.body):
            self.wfile.write(block)

    def log_message(self, format: str, *args) -> None:  # noqa: A002 (inherited signature)
        log.debug("%s %s", self.address_string(), format % args)
