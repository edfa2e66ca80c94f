"""The exporter's own HTTP endpoint, served on the poll loop's asyncio event loop: routes, optional
TLS and basic auth (webconfig), and the limits that keep it up against hostile or careless clients.

No thread per connection: an idle connection costs a few KB and no thread, so thousands of them
cost little (docs/robustness.md has the figures). What a connection may hold is bounded:

- a new connection must send its request head within HEAD_TIMEOUT, and a kept-alive one its
  next request within IDLE_TIMEOUT; a head is at most MAX_HEAD_BYTES;
- at most `max_connections` connections; when a new one arrives at the cap, the connection that
  has waited longest on its client (for a request head, a body, or to read a response) is closed
  to make room, so a flood of idle or slow connections can never lock Prometheus out; only when
  every connection is being answered is the newcomer told 503 and closed;
- a request body is read whole (at most MAX_BODY_BYTES, else 413 and close) before the next
  request is read, so nothing can be smuggled in a body; Transfer-Encoding is refused;
- a response is written with backpressure, and a client that stops reading it is dropped after
  WRITE_TIMEOUT.

CPU work that takes milliseconds (rendering /metrics, gzip, bcrypt) runs in worker threads, so
the loop's polls and other clients' requests do not wait behind it.

Every authorized GET of /metrics is reported to the scheduler's ScrapeClock (exporter/runtime/phase.py)
with the time its first byte was read, its client's address and User-Agent, and whether it carries
Prometheus' scrape timeout header: the polls lock onto a regular scraper. A dictionary lookup and an
append per scrape; what a client can do with it is bounded there.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import socket
import ssl
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from email.utils import formatdate
from typing import Awaitable, Callable
from urllib.parse import parse_qs, urlsplit

from .phase import ScrapeClock
from .probe import SCRAPE_TIMEOUT_HEADER
from .webconfig import WebConfig

log = logging.getLogger(__name__)

HEAD_TIMEOUT = 10.0  # a request head (or a TLS handshake) must arrive within this
IDLE_TIMEOUT = 90.0  # a kept-alive connection may wait this long for its next request
WRITE_TIMEOUT = 30.0  # a client must take each block of a response within this
MAX_HEAD_BYTES = 16 * 1024  # request line and headers (a /probe URL fits many times over)
MAX_HEADERS = 100
MAX_BODY_BYTES = 64 * 1024  # no route reads a body; a small one is read and dropped
MAX_CONNECTIONS = 1024
BACKLOG = 1024
SERVER = "kvcache-exporter"  # no version of Python or of the exporter: nothing to fingerprint
SCRAPE_PATH = "/metrics"  # the route whose requests are scrapes


@dataclass
class Request:
    method: str
    path: str
    query: dict[str, list[str]]
    headers: dict[str, str]  # names in lower case
    client: str = ""  # its address and User-Agent: who scrapes (phase.ScrapeClock's key)
    arrived: float = 0.0  # monotonic time its first byte was read


@dataclass
class Response:
    status: int
    body: bytes | list[bytes]  # a list: parts sent one after the other, never joined whole
    content_type: str = "text/plain; charset=utf-8"
    headers: dict[str, str] = field(default_factory=dict)


Route = Callable[[Request], Awaitable[Response]]

REASONS = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 403: "Forbidden", 404: "Not Found",
           405: "Method Not Allowed", 408: "Request Timeout", 413: "Content Too Large",
           431: "Request Header Fields Too Large", 500: "Internal Server Error", 501: "Not Implemented",
           503: "Service Unavailable", 505: "HTTP Version Not Supported"}


class BadRequest(Exception):
    """A request the server answers with `status` and then closes the connection on."""

    def __init__(self, status: int, reason: str):
        super().__init__(reason)
        self.status = status


def raise_fd_limit() -> int:
    """Raise this process's descriptor soft limit to its hard limit (as Go programs do at start); return it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        wanted = 1 << 20 if hard == resource.RLIM_INFINITY else hard
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
            soft = wanted
        except (ValueError, OSError):
            pass
    return soft


def bind(listen: str) -> socket.socket:
    """A listening socket for HOST:PORT (an empty host or 0.0.0.0: every IPv4 address). Raises OSError
    (socket.gaierror for a host that does not resolve)."""
    host, _, port = listen.rpartition(":")
    host = host.strip("[]") or "0.0.0.0"
    family, kind, proto, _, address = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM,
                                                         flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(BACKLOG)
    except OSError:
        sock.close()
        raise
    sock.setblocking(False)
    return sock


class _Connection:
    __slots__ = ("writer", "task", "waiting_since")

    def __init__(self, writer: asyncio.StreamWriter):
        self.writer = writer
        self.task = asyncio.current_task()
        self.waiting_since: float | None = time.monotonic()  # None while the server works on a request


class MetricsServer:
    def __init__(self, listen: str, routes: dict[tuple[str, str], Route], web: WebConfig | None = None,
                 max_connections: int = MAX_CONNECTIONS, scrapes: ScrapeClock | None = None):
        self.listen = listen
        self.scrapes = scrapes
        self.routes = routes
        self.web = web or WebConfig()
        self.max_connections = max_connections
        self._sock: socket.socket | None = None
        self._server: asyncio.Server | None = None
        self._connections: dict[_Connection, None] = {}
        # bcrypt gets its own two threads: a flood of wrong passwords must not delay a scrape's rendering.
        self._auth_pool = ThreadPoolExecutor(2, thread_name_prefix="http-auth")

    def bind(self) -> None:
        """Bind and listen now, so that a port in use is an error at start, before anything else runs."""
        limit = raise_fd_limit()
        self.max_connections = min(self.max_connections, max(16, limit // 4))
        self._sock = bind(self.listen)

    @property
    def port(self) -> int:
        return self._sock.getsockname()[1]

    async def serve(self) -> None:
        """Start accepting, in the event loop that runs this."""
        self._server = await asyncio.start_server(self._handle, sock=self._sock, limit=MAX_HEAD_BYTES,
                                                  backlog=BACKLOG)

    async def close(self) -> None:
        """Stop accepting, and end every connection and the requests they are in."""
        if self._server is not None:
            self._server.close()
        tasks = [connection.task for connection in self._connections]
        for connection in list(self._connections):
            connection.writer.transport.abort()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._auth_pool.shutdown(wait=False, cancel_futures=True)

    def close_socket(self) -> None:
        """The listening socket, when the loop never started serving it."""
        if self._server is None and self._sock is not None:
            self._sock.close()

    # -- connections --------------------------------------------------------------------------

    def _make_room(self) -> bool:
        """At the cap: close the connection that has waited longest on its client. False if none waits."""
        waiting = [c for c in self._connections if c.waiting_since is not None]
        if not waiting:
            return False
        oldest = min(waiting, key=lambda c: c.waiting_since)
        del self._connections[oldest]
        oldest.writer.transport.abort()
        return True

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if len(self._connections) >= self.max_connections and not self._make_room():
            writer.write(_head(503, "text/plain; charset=utf-8", 13, {"Connection": "close"}) + b"server busy\r\n")
            writer.transport.close()
            return
        connection = _Connection(writer)
        self._connections[connection] = None
        try:
            if self.web.tls is not None:
                await writer.start_tls(self.web.tls, ssl_handshake_timeout=HEAD_TIMEOUT)
            first = True
            while await self._exchange(reader, writer, connection, first):
                first = False
        except (OSError, EOFError, TimeoutError, ssl.SSLError, asyncio.IncompleteReadError) as err:
            log.debug("connection ended: %s", type(err).__name__)
        except asyncio.CancelledError:
            pass
        finally:
            self._connections.pop(connection, None)
            writer.close()

    async def _exchange(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                        connection: _Connection, first: bool) -> bool:
        """Read one request, answer it; True if the connection stays open for another."""
        connection.waiting_since = time.monotonic()
        try:
            async with asyncio.timeout(HEAD_TIMEOUT if first else IDLE_TIMEOUT):
                start = await reader.read(1)
            if not start:
                return False
            arrived = time.monotonic()
            async with asyncio.timeout(HEAD_TIMEOUT):
                head = start + await reader.readuntil(b"\r\n\r\n")
                method, target, version, headers = _parse_head(head)
                await _read_body(reader, headers)
        except asyncio.LimitOverrunError:
            await self._send(writer, connection, "GET", _error(431, "request head too large"), close=True)
            return False
        except BadRequest as err:
            await self._send(writer, connection, "GET", _error(err.status, str(err)), close=True)
            return False
        connection.waiting_since = None
        keep_alive = version == "HTTP/1.1" and "close" not in headers.get("connection", "").lower()
        response = await self._respond(method, target, headers, writer, arrived)
        await self._send(writer, connection, method, response, close=not keep_alive)
        return keep_alive

    async def _respond(self, method: str, target: str, headers: dict[str, str], writer: asyncio.StreamWriter,
                       arrived: float) -> Response:
        url = urlsplit(target)
        if self.web.users:
            authorized = await asyncio.get_running_loop().run_in_executor(
                self._auth_pool, self.web.authorized, headers.get("authorization"))
            if not authorized:
                return Response(401, b"unauthorized\n", headers={"WWW-Authenticate": 'Basic realm="kvcache-exporter"'})
        peer = writer.get_extra_info("peername")
        client = f"{peer[0] if peer else ''} {headers.get('user-agent', '')}"
        if self.scrapes is not None and url.path == SCRAPE_PATH and method == "GET":
            self.scrapes.observe(client, arrived, SCRAPE_TIMEOUT_HEADER in headers)
        route = self.routes.get(("GET" if method == "HEAD" else method, url.path))
        if route is None:
            known = any(path == url.path for _, path in self.routes)
            return _error(405, "method not allowed") if known else _error(404, "not found")
        try:
            response = await route(Request(method, url.path, parse_qs(url.query), headers, client, arrived))
        except Exception:  # a bug in one route must not take the endpoint down; the client learns nothing
            log.exception("error serving %s", url.path)
            return _error(500, "internal error")
        if "gzip" in headers.get("accept-encoding", "") and _size(response.body) >= GZIP_MIN_BYTES and method != "HEAD":
            response.body = await asyncio.to_thread(_gzip, response.body)
            response.headers["Content-Encoding"] = "gzip"
        return response

    async def _send(self, writer: asyncio.StreamWriter, connection: _Connection, method: str, response: Response,
                    close: bool) -> None:
        headers = {**self.web.headers, **response.headers}
        if close:
            headers["Connection"] = "close"
        writer.write(_head(response.status, response.content_type, _size(response.body), headers))
        connection.waiting_since = time.monotonic()  # from here on the client holds it up, if anyone
        if method != "HEAD":
            for block in _blocks(response.body):
                writer.write(block)
                async with asyncio.timeout(WRITE_TIMEOUT):
                    await writer.drain()
        async with asyncio.timeout(WRITE_TIMEOUT):
            await writer.drain()


# Smaller bodies (a probe's page, 15 to 25 KB) go uncompressed even when gzip is asked for: gzip
# cost both ends more CPU than the bytes saved are worth on a cluster network, and an engine's
# own page, which Prometheus would fetch instead, is larger and often uncompressed too
# (docs/performance.md).
GZIP_MIN_BYTES = 64 * 1024

_TOKEN_CHARS = frozenset("!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")


def _parse_head(head: bytes) -> tuple[str, str, str, dict[str, str]]:
    request_line, *lines = head.decode("latin-1").lstrip("\r\n").split("\r\n")
    parts = request_line.split(" ")
    if len(parts) != 3 or not parts[0] or not set(parts[0]) <= _TOKEN_CHARS:
        raise BadRequest(400, "malformed request line")
    method, target, version = parts
    if version not in ("HTTP/1.1", "HTTP/1.0"):
        raise BadRequest(505, "HTTP/1.0 and HTTP/1.1 only")
    if not target.startswith("/"):
        raise BadRequest(400, "request target must be a path")
    headers: dict[str, str] = {}
    fields = [line for line in lines if line]
    if len(fields) > MAX_HEADERS:
        raise BadRequest(431, "too many header fields")
    for line in fields:
        name, sep, value = line.partition(":")
        if not sep or not name or not set(name) <= _TOKEN_CHARS:  # also refuses obsolete line folding
            raise BadRequest(400, "malformed header field")
        name, value = name.lower(), value.strip(" \t")
        if name in headers:
            if name in ("content-length", "transfer-encoding", "host", "authorization"):
                raise BadRequest(400, f"{name} given twice")
            value = headers[name] + ", " + value
        headers[name] = value
    return method, target, version, headers


async def _read_body(reader: asyncio.StreamReader, headers: dict[str, str]) -> None:
    """Read and drop the body, so that the next request starts where this one ends."""
    if "transfer-encoding" in headers:  # a chunked body and a Content-Length at once is the smuggler's tool
        raise BadRequest(501, "Transfer-Encoding is not supported: send Content-Length")
    length = headers.get("content-length", "0")
    if not length.isdigit() or not length.isascii():
        raise BadRequest(400, "malformed Content-Length")
    if int(length) > MAX_BODY_BYTES:
        raise BadRequest(413, f"request body above {MAX_BODY_BYTES} bytes")
    if int(length):
        await reader.readexactly(int(length))


def _error(status: int, reason: str) -> Response:
    return Response(status, reason.encode() + b"\n")


def _head(status: int, content_type: str, length: int, headers: dict[str, str]) -> bytes:
    lines = [f"HTTP/1.1 {status} {REASONS.get(status, 'Status')}", f"Server: {SERVER}",
             f"Date: {formatdate(usegmt=True)}", f"Content-Type: {content_type}", f"Content-Length: {length}"]
    lines += [f"{name}: {value}" for name, value in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


# Parts are joined into blocks of about this size before a send or a compression call: a call per
# part (tens of thousands of small ones at 2,000 targets) would cost more than the copy. A client
# that reads slowly holds one block in memory at a time.
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
