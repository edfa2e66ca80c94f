"""A real HTTP server on loopback whose routes misbehave on purpose, for the exporter's fault tests."""

from __future__ import annotations

import itertools
import socket
import struct
import threading
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable

Route = Callable[[BaseHTTPRequestHandler], None]


def page(body: str | bytes, status: int = 200, content_type: str = "text/plain; version=0.0.4",
         headers: dict | None = None) -> Route:
    data = body.encode() if isinstance(body, str) else body

    def route(handler: BaseHTTPRequestHandler) -> None:
        handler.send_response(status)
        handler.send_header("Content-Type", content_type)
        handler.send_header("Content-Length", str(len(data)))
        for name, value in (headers or {}).items():
            handler.send_header(name, value)
        handler.end_headers()
        handler.wfile.write(data)

    return route


def dynamic(make_body: Callable[[], str]) -> Route:
    """A page rebuilt at every request (pages that change between polls)."""
    return lambda handler: page(make_body())(handler)


def hang_after_headers(seconds: float = 3600) -> Route:
    def route(handler: BaseHTTPRequestHandler) -> None:
        handler.send_response(200)
        handler.send_header("Content-Length", "500")
        handler.end_headers()
        handler.wfile.flush()
        handler.server.stopping.wait(seconds)

    return route


def hang_before_headers(seconds: float = 3600) -> Route:
    return lambda handler: handler.server.stopping.wait(seconds)


def trickle(body: str, interval: float) -> Route:
    """Sends one byte every `interval` seconds: each read succeeds, the whole never arrives in time."""

    def route(handler: BaseHTTPRequestHandler) -> None:
        data = body.encode()
        handler.send_response(200)
        handler.send_header("Content-Length", str(len(data)))
        handler.end_headers()
        for byte in data:
            if handler.server.stopping.wait(interval):
                return
            handler.wfile.write(bytes([byte]))
            handler.wfile.flush()

    return route


def reset_connection() -> Route:
    """Closes the connection with a TCP reset before answering."""

    def route(handler: BaseHTTPRequestHandler) -> None:
        handler.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        handler.connection.close()
        handler.close_connection = True

    return route


def redirect(location: str) -> Route:
    def route(handler: BaseHTTPRequestHandler) -> None:
        handler.send_response(302)
        handler.send_header("Location", location)
        handler.send_header("Content-Length", "0")
        handler.end_headers()

    return route


def endless(chunk: bytes = b"# padding line of an endless page\n" * 1024) -> Route:
    """Streams chunks (chunked encoding) until the client goes away: a page of unbounded size."""

    def route(handler: BaseHTTPRequestHandler) -> None:
        handler.send_response(200)
        handler.send_header("Transfer-Encoding", "chunked")
        handler.end_headers()
        try:
            for _ in range(1 << 30 // len(chunk)):
                handler.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        except OSError:
            handler.close_connection = True

    return route


def gzip_bomb(expanded_bytes: int) -> Route:
    """A small gzip body that inflates to `expanded_bytes` of newlines."""
    compressor = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    block = b"\n" * (1 << 20)
    body = b"".join(compressor.compress(block) for _ in range(expanded_bytes >> 20)) + compressor.flush()
    return page(body, headers={"Content-Encoding": "gzip"})


def alternating(*routes: Route) -> Route:
    """Each request takes the next route in turn (a target that flaps)."""
    turns = itertools.cycle(routes)
    return lambda handler: next(turns)(handler)


class PageServer:
    """Routes by path; `set_route` swaps behaviour while the server runs."""

    def __init__(self, routes: dict[str, Route]):
        self.routes = dict(routes)
        self.requests: dict[str, int] = {}
        self.connections: set = set()
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def setup(self):
                super().setup()
                server.connections.add(self.connection)

            def do_GET(self):  # noqa: N802
                path = self.path.split("?", 1)[0]
                server.requests[path] = server.requests.get(path, 0) + 1
                route = server.routes.get(path)
                if route is None:
                    page("not found\n", status=404)(self)
                else:
                    route(self)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.httpd.stopping = threading.Event()
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}{path}"

    def set_route(self, path: str, route: Route) -> None:
        self.routes[path] = route

    def __enter__(self) -> "PageServer":
        self._thread.start()
        return self

    def stop(self) -> None:
        """Like a killed process: the listener and every open keep-alive connection go away."""
        self.httpd.stopping.set()
        self.httpd.shutdown()
        self.httpd.server_close()
        for connection in list(self.connections):
            try:
                connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def __exit__(self, *exc) -> None:
        if not self.httpd.stopping.is_set():
            self.stop()

