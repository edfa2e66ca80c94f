"""The exporter's own HTTP endpoint: /metrics, /healthz, /ready."""

from __future__ import annotations

import gzip
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

log = logging.getLogger(__name__)


class MetricsServer:
    def __init__(self, listen: str, registry: CollectorRegistry, is_ready: Callable[[], bool]):
        host, _, port = listen.rpartition(":")
        handler = type("Handler", (_Handler,), {"registry": registry, "is_ready": staticmethod(is_ready)})
        self.httpd = ThreadingHTTPServer((host.strip("[]") or "0.0.0.0", int(port)), handler)
        self.httpd.daemon_threads = True
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="http", daemon=True)

    @property
    def port(self) -> int:
        return self.httpd.server_address[1]

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class _Handler(BaseHTTPRequestHandler):
    registry: CollectorRegistry
    is_ready: Callable[[], bool]
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        path = self.path.split("?", 1)[0]
        if path == "/metrics":
            encoder, content_type = choose_encoder(self.headers.get("Accept"))
            body = encoder(self.registry)
            headers = {"Content-Type": content_type}
            if "gzip" in self.headers.get("Accept-Encoding", ""):
                body = gzip.compress(body, compresslevel=1)
                headers["Content-Encoding"] = "gzip"
            self._reply(200, body, headers)
        elif path == "/healthz":
            self._reply(200, b"ok\n")
        elif path == "/ready":
            ready = self.is_ready()
            self._reply(200 if ready else 503, b"ready\n" if ready else b"first poll cycle not done\n")
        elif path == "/":
            self._reply(200, b"kvcache-exporter: see /metrics\n")
        else:
            self._reply(404, b"not found\n")

    def _reply(self, status: int, body: bytes, headers: dict | None = None) -> None:
        self.send_response(status)
        for name, value in (headers or {"Content-Type": "text/plain; charset=utf-8"}).items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args) -> None:  # noqa: A002 (inherited signature)
        log.debug("%s %s", self.address_string(), format % args)
