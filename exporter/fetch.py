"""HTTP GET of one target's page: persistent connection, hard deadline, size cap, same-host redirects.

Knows HTTP and nothing of engines. Every failure is a FetchError whose `reason` is one of the
`kvcache_target_scrape_failures_total` reasons. Built on http.client: at fleet scale the poll's
HTTP cost dominates, and requests spends about eight times the CPU of http.client per GET of
the same page (bench/http_client.py).
"""

from __future__ import annotations

import base64
import http.client
import os
import socket
import ssl
import time
import zlib
from dataclasses import dataclass
from urllib.parse import urljoin, urlsplit

# Text 0.0.4 only: prometheus_client ignores q-values and answers OpenMetrics to any Accept that
# names it, and its recent versions then rewrite `vllm:` to `vllm_` on sample lines.
ACCEPT = "text/plain;version=0.0.4"
MAX_REDIRECTS = 3
_CHUNK = 256 * 1024
# A kept-alive connection the server closed meanwhile fails on first use: retry once on a new one.
_STALE_CONNECTION = (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError)


class FetchError(Exception):
    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True)
class FetchSettings:
    timeout: float
    max_bytes: int
    bearer_token_file: str | None = None
    basic_auth_username: str | None = None
    basic_auth_password_file: str | None = None
    ca_file: str | None = None
    verify_tls: bool = True


class SecretFile:
    """A credential read from a file, re-read only when the file changes; never logged."""

    def __init__(self, path: str):
        self.path = path
        self._stamp: tuple[float, int] | None = None
        self._value = ""

    def read(self) -> str:
        stat = os.stat(self.path)
        stamp = (stat.st_mtime, stat.st_size)
        if stamp != self._stamp:
            with open(self.path, encoding="utf-8") as handle:
                self._value = handle.read().strip()
            self._stamp = stamp
        return self._value


class Fetcher:
    def __init__(self, url: str, settings: FetchSettings):
        self.url = url
        self.settings = settings
        parts = urlsplit(url)
        self._scheme, self._netloc = parts.scheme, parts.netloc
        self._host, self._port = parts.hostname, parts.port
        self._tls = _tls_context(settings) if parts.scheme == "https" else None
        self._token = SecretFile(settings.bearer_token_file) if settings.bearer_token_file else None
        self._password = SecretFile(settings.basic_auth_password_file) if settings.basic_auth_password_file else None
        self._connection: http.client.HTTPConnection | None = None

    def close(self) -> None:
        if self._connection is not None:
            self._connection.close()
            self._connection = None

    def fetch(self) -> bytes:
        deadline = time.monotonic() + self.settings.timeout
        headers = {"Accept": ACCEPT, "Accept-Encoding": "gzip", "User-Agent": "kvcache-exporter"}
        try:
            if self._token is not None:
                headers["Authorization"] = "Bearer " + self._token.read()
            elif self._password is not None:
                pair = f"{self.settings.basic_auth_username}:{self._password.read()}".encode()
                headers["Authorization"] = "Basic " + base64.b64encode(pair).decode()
        except OSError as err:
            raise FetchError("connect", f"credentials file {err.filename}: {err.strerror}") from None
        url = self.url
        for _ in range(MAX_REDIRECTS + 1):
            response = self._get(url, headers, deadline)
            if response.status in (301, 302, 303, 307, 308):
                location = urljoin(url, response.getheader("Location", ""))
                self._drain(response, deadline)
                target = urlsplit(location)
                if (target.scheme, target.netloc) != (self._scheme, self._netloc):
                    raise FetchError("http_status", f"redirect to another host refused: {location}")
                url = location
                continue
            if response.status != 200:
                self._drain(response, deadline)
                raise FetchError("http_status", f"HTTP {response.status}")
            return self._read_body(response, deadline)
        raise FetchError("http_status", "too many redirects")

    def _get(self, url: str, headers: dict, deadline: float) -> http.client.HTTPResponse:
        parts = urlsplit(url)
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        for attempt in (1, 2):
            reused = self._connection is not None
            connection = self._connect(deadline)
            try:
                connection.request("GET", path, headers=headers)
                return connection.getresponse()
            except _STALE_CONNECTION:
                self.close()
                if attempt == 2 or not reused:
                    raise FetchError("connect", "connection closed by the target") from None
            except (TimeoutError, socket.timeout):
                self.close()
                raise FetchError("timeout", f"no response within {self.settings.timeout:g}s") from None
            except ssl.SSLError as err:
                self.close()
                raise FetchError("connect", f"TLS: {err.reason or err}") from None
            except (OSError, http.client.HTTPException) as err:
                self.close()
                raise FetchError("connect", type(err).__name__) from None
        raise AssertionError("unreachable")

    def _connect(self, deadline: float) -> http.client.HTTPConnection:
        remaining = max(deadline - time.monotonic(), 0.001)
        if self._connection is None:
            if self._tls is not None:
                self._connection = http.client.HTTPSConnection(self._host, self._port, timeout=remaining,
                                                               context=self._tls)
            else:
                self._connection = http.client.HTTPConnection(self._host, self._port, timeout=remaining)
        else:
            self._connection.timeout = remaining
            if self._connection.sock is not None:
                self._connection.sock.settimeout(remaining)
        return self._connection

    def _drain(self, response: http.client.HTTPResponse, deadline: float) -> None:
        """Read a small body to keep the connection usable; a large one closes it instead."""
        try:
            self._read_body(response, deadline, limit=64 * 1024)
        except FetchError:
            self.close()

    def _read_body(self, response: http.client.HTTPResponse, deadline: float, limit: int | None = None) -> bytes:
        """Read the body within the deadline, decompressing gzip ourselves so that the cap counts
        decompressed bytes and a compression bomb stops at the cap, not in memory."""
        limit = self.settings.max_bytes if limit is None else limit
        declared = response.getheader("Content-Length")
        encoding = (response.getheader("Content-Encoding") or "identity").lower()
        if encoding not in ("identity", "gzip"):
            self.close()
            raise FetchError("parse", f"unsupported Content-Encoding {encoding}")
        if encoding == "identity" and declared and declared.isdigit() and int(declared) > limit:
            self.close()
            raise FetchError("too_large", f"Content-Length {declared} exceeds {limit}")
        inflater = zlib.decompressobj(16 + zlib.MAX_WBITS) if encoding == "gzip" else None
        sock = self._connection.sock if self._connection is not None else None
        parts: list[bytes] = []
        size = 0
        try:
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise FetchError("timeout", f"body not complete within {self.settings.timeout:g}s")
                if sock is not None:
                    sock.settimeout(remaining)  # read1 does at most one socket read, so this bounds it
                chunk = response.read1(_CHUNK)
                if not chunk:
                    break
                if inflater is not None:
                    chunk = inflater.decompress(chunk, limit - size + 1)
                    if inflater.unconsumed_tail:
                        raise FetchError("too_large", f"decompressed body exceeds {limit} bytes")
                size += len(chunk)
                if size > limit:
                    raise FetchError("too_large", f"body exceeds {limit} bytes")
                parts.append(chunk)
        except FetchError:
            self.close()
            raise
        except (TimeoutError, socket.timeout):
            self.close()
            raise FetchError("timeout", f"body not complete within {self.settings.timeout:g}s") from None
        except zlib.error:
            self.close()
            raise FetchError("parse", "corrupt gzip body") from None
        except (OSError, http.client.HTTPException) as err:
            self.close()
            raise FetchError("connect", f"connection broken: {type(err).__name__}") from None
        response.close()  # read1 leaves a finished response open; the connection needs it closed for reuse
        if response.will_close:
            self.close()
        return b"".join(parts)


def _tls_context(settings: FetchSettings) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=settings.ca_file)
    if not settings.verify_tls:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    return context
