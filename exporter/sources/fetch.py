"""HTTP GET of one target's page: persistent connection, hard deadline, size cap, same-host redirects.

Knows HTTP and nothing of engines. Every failure is a FetchError whose `reason` is one of the
`kvcache_target_scrape_failures_total` reasons. A small HTTP/1.1 client on asyncio streams: the
exporter polls its whole fleet from one event loop thread, because poll threads contending for
the GIL cost more CPU than the polls themselves (docs/performance.md). A GET of a 37 KB page costs
91 µs of CPU here, 67 µs with http.client and 447 µs with requests (bench/http_client.py; the
figure for this client includes starting the event loop for each request, which polling doesn't).
"""

from __future__ import annotations

import asyncio
import base64
import os
import re
import ssl
import stat
import zlib
from dataclasses import dataclass
from typing import AbstractSet
from urllib.parse import urlencode, urljoin, urlsplit

# Text 0.0.4 only: prometheus_client ignores q-values and answers OpenMetrics to any Accept that
# names it, and its recent versions then rewrite `vllm:` to `vllm_` on sample lines.
ACCEPT = "text/plain;version=0.0.4"
# Sent on every poll; /probe refuses requests that carry it, so a probe can never poll a probe.
USER_AGENT = "kvcache-exporter"
MAX_REDIRECTS = 3
MAX_HEAD_BYTES = 64 * 1024  # status line and headers
_CHUNK = 256 * 1024
_REDIRECTS = (301, 302, 303, 307, 308)


class FetchError(Exception):
    def __init__(self, reason: str, detail: str, status: int | None = None):
        super().__init__(detail)  # the log line names the reason apart
        self.reason = reason
        self.detail = detail
        self.status = status  # the HTTP status of an `http_status` failure


@dataclass(frozen=True)
class FetchSettings:
    timeout: float
    max_bytes: int
    bearer_token_file: str | None = None
    basic_auth_username: str | None = None
    basic_auth_password_file: str | None = None
    ca_pem: str | None = None  # the CA bundle's text (config.py reads the ca_file once, at load); None: the system's
    verify_tls: bool = True


class FileProblem(ValueError):
    """A file a target's settings name cannot serve: the message names the file and says why."""


def read_credential(path: str) -> str:
    """A bearer token's or a password's file, without surrounding whitespace. Raises FileProblem."""
    value = read_text(path).strip()
    if not value:
        raise FileProblem(f"{path} is empty")
    if "\r" in value or "\n" in value:  # it would end the header and start one of its own
        raise FileProblem(f"{path} holds a line break")
    return value


def read_certificates(path: str) -> str:
    """A file of PEM certificates (a CA bundle, a certificate chain), checked by loading it as a fetch loads a
    target's CA bundle. Raises FileProblem."""
    pem = read_text(path)
    if not pem.strip():  # no text at all would leave the system's CAs trusted
        raise FileProblem(f"{path} is empty")
    try:
        tls_context(pem)
    except ssl.SSLError as err:
        raise FileProblem(f"{path} holds no PEM certificate: {ssl_problem(err)}") from None
    return pem


def ssl_problem(err: ssl.SSLError) -> str:
    """OpenSSL's words for a failure, without the (_ssl.c:LINE) of the Python build."""
    return re.sub(r" \(_ssl\.c:\d+\)$", "", str(err.args[1] if len(err.args) > 1 else err))


def read_text(path: str) -> str:
    """A regular file's UTF-8 text. Raises FileProblem naming the file."""
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):  # a FIFO or a device would block or never end
            raise FileProblem(f"{path} is not a regular file")
        with open(path, encoding="utf-8") as handle:
            return handle.read()
    except OSError as err:
        raise FileProblem(f"cannot read {path}: {err.strerror or err}") from None
    except UnicodeDecodeError:
        raise FileProblem(f"{path} is not UTF-8 text") from None


class SecretFile:
    """A credential read from a file, re-read only when the file changes; never logged."""

    def __init__(self, path: str):
        self.path = path
        self._stamp: tuple[float, int] | None = None
        self._value = ""

    def read(self) -> str:
        """Raises FetchError (`credentials`) if the file cannot serve."""
        try:
            status = os.stat(self.path)
            stamp = (status.st_mtime, status.st_size)
            if stamp != self._stamp:
                self._value, self._stamp = read_credential(self.path), stamp
        except OSError as err:
            raise FetchError("credentials", f"cannot read {self.path}: {err.strerror or err}") from None
        except FileProblem as err:
            raise FetchError("credentials", str(err)) from None
        return self._value


class Fetcher:
    """One target's connection. Every method runs in the event loop thread that polls the target."""

    def __init__(self, url: str, settings: FetchSettings):
        self.url = url
        self.settings = settings
        parts = urlsplit(url)
        self._scheme, self._netloc = parts.scheme, parts.netloc
        self._host = parts.hostname
        self._port = parts.port or (443 if parts.scheme == "https" else 80)
        self._host_header = parts.netloc.rpartition("@")[2]
        self._tls = tls_context(settings.ca_pem, settings.verify_tls) if parts.scheme == "https" else None
        self._token = SecretFile(settings.bearer_token_file) if settings.bearer_token_file else None
        self._password = SecretFile(settings.basic_auth_password_file) if settings.basic_auth_password_file else None
        self._stream: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        self._filtered: tuple[AbstractSet[str], str] | None = None  # (names, the URL asking for them only)

    def close(self) -> None:
        if self._stream is not None:
            self._stream[1].close()
            self._stream = None

    async def fetch(self, timeout: float | None = None, names: AbstractSet[str] | None = None) -> bytes:
        """The page; with `names`, asked for those series only (`?name[]=...`, which prometheus_client's
        exposition honours: it filters by sample name, a counter's `_total` and a histogram's `_bucket`,
        `_sum` and `_count` included). Whether the engine honoured it is for the caller to judge."""
        headers = self._headers()
        timeout = self.settings.timeout if timeout is None else timeout
        try:
            async with asyncio.timeout(timeout):
                return await self._follow(headers, self.url if names is None else self._filtered_url(names))
        except TimeoutError:  # the deadline covers everything: connect, a trickled head, a trickled body
            self.close()
            raise FetchError("timeout", f"no complete response within {timeout:g}s") from None

    def _headers(self) -> str:
        headers = {"Host": self._host_header, "Accept": ACCEPT, "Accept-Encoding": "gzip",
                   "User-Agent": USER_AGENT}
        if self._token is not None:
            headers["Authorization"] = "Bearer " + self._token.read()
        elif self._password is not None:
            pair = f"{self.settings.basic_auth_username}:{self._password.read()}".encode()
            headers["Authorization"] = "Basic " + base64.b64encode(pair).decode()
        return "".join(f"{name}: {value}\r\n" for name, value in headers.items())

    def _filtered_url(self, names: AbstractSet[str]) -> str:
        if self._filtered is None or self._filtered[0] is not names:
            query = urlencode([("name[]", name) for name in sorted(names)])
            self._filtered = names, self.url + ("&" if urlsplit(self.url).query else "?") + query
        return self._filtered[1]

    async def _follow(self, headers: str, url: str) -> bytes:
        for _ in range(MAX_REDIRECTS + 1):
            status, response_headers = await self._exchange(url, headers)
            if status in _REDIRECTS:
                location = urljoin(url, response_headers.get("location", ""))
                await self._drain(status, response_headers)
                target = urlsplit(location)
                if (target.scheme, target.netloc) != (self._scheme, self._netloc):
                    raise FetchError("http_status", f"redirect to another host refused: {location}")
                url = location
                continue
            if status != 200:
                await self._drain(status, response_headers)
                raise FetchError("http_status", f"HTTP {status}", status)
            return await self._body(status, response_headers, self.settings.max_bytes)
        raise FetchError("http_status", "too many redirects")

    async def _exchange(self, url: str, headers: str) -> tuple[int, dict[str, str]]:
        """Send the GET and read the response's head, on the kept-alive connection if there is one."""
        parts = urlsplit(url)
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        request = f"GET {path} HTTP/1.1\r\n{headers}\r\n".encode("latin-1")
        for attempt in (1, 2):
            reused = self._stream is not None
            try:
                if self._stream is None:
                    self._stream = await asyncio.open_connection(
                        self._host, self._port, ssl=self._tls, limit=MAX_HEAD_BYTES,
                        server_hostname=self._host if self._tls else None)
                reader, writer = self._stream
                writer.write(request)
                head = await reader.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, ConnectionResetError, BrokenPipeError) as err:
                self.close()
                nothing_read = not isinstance(err, asyncio.IncompleteReadError) or not err.partial
                if reused and attempt == 1 and nothing_read:
                    continue  # the target closed the kept-alive connection meanwhile: once more on a new one
                raise FetchError("connect", "connection closed by the target") from None
            except asyncio.LimitOverrunError:
                self.close()
                raise FetchError("connect", f"response head longer than {MAX_HEAD_BYTES} bytes") from None
            except ssl.SSLError as err:
                self.close()
                raise FetchError("connect", f"TLS: {err.reason or err}") from None
            except OSError as err:
                self.close()
                raise FetchError("connect", type(err).__name__) from None
            return self._parse_head(head)
        raise AssertionError("unreachable")

    def _parse_head(self, head: bytes) -> tuple[int, dict[str, str]]:
        status_line, *lines = head.decode("latin-1").split("\r\n")
        version, _, rest = status_line.partition(" ")
        if not version.startswith("HTTP/1.") or not rest[:3].isdigit():
            self.close()
            raise FetchError("connect", f"not an HTTP response: {status_line[:40]!r}")
        headers = {}
        for line in lines:
            name, sep, value = line.partition(":")
            if sep:
                headers[name.strip().lower()] = value.strip()
        connection = headers.get("connection", "").lower()
        if connection == "close" or (version == "HTTP/1.0" and connection != "keep-alive"):
            headers["connection"] = "close"
        return int(rest[:3]), headers

    async def _drain(self, status: int, headers: dict[str, str]) -> None:
        """Read a small body to keep the connection usable; a large one closes it instead."""
        try:
            await self._body(status, headers, limit=64 * 1024)
        except FetchError:
            self.close()

    async def _body(self, status: int, headers: dict[str, str], limit: int) -> bytes:
        """Read the body as framed (length, chunks, or until the target closes), decompressing gzip
        ourselves so that the cap counts decompressed bytes and a compression bomb stops at the cap."""
        encoding = headers.get("content-encoding", "identity").lower()
        if encoding not in ("identity", "gzip"):
            self.close()
            raise FetchError("parse", f"unsupported Content-Encoding {encoding}")
        chunked = "chunked" in headers.get("transfer-encoding", "").lower()
        declared = "0" if status in (204, 304) else headers.get("content-length")
        if not chunked and declared is not None:
            if not declared.isdigit():
                self.close()
                raise FetchError("connect", f"bad Content-Length {declared[:40]!r}")
            if encoding == "identity" and int(declared) > limit:
                self.close()
                raise FetchError("too_large", f"Content-Length {declared} exceeds {limit}")
        body = _Body(limit, encoding == "gzip")
        reader = self._stream[0]
        try:
            if chunked:
                while size := int((await reader.readuntil(b"\r\n")).split(b";", 1)[0], 16):
                    await _read_exactly(reader, size, body)
                    await reader.readexactly(2)
                while await reader.readuntil(b"\r\n") != b"\r\n":  # trailers
                    pass
            elif declared is not None:
                await _read_exactly(reader, int(declared), body)
            else:  # no framing: the body ends when the target closes the connection
                while chunk := await reader.read(_CHUNK):
                    body.add(chunk)
                headers["connection"] = "close"
        except FetchError:
            self.close()
            raise
        except zlib.error:
            self.close()
            raise FetchError("parse", "corrupt gzip body") from None
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError, OSError) as err:
            self.close()
            raise FetchError("connect", f"connection broken: {type(err).__name__}") from None
        if headers.get("connection") == "close":
            self.close()
        return body.bytes()


class _Body:
    """A response body as it arrives: inflated if gzip, and stopped at the cap."""

    def __init__(self, limit: int, gzip: bool):
        self.limit = limit
        self.size = 0
        self.parts: list[bytes] = []
        self.inflater = zlib.decompressobj(16 + zlib.MAX_WBITS) if gzip else None

    def add(self, chunk: bytes) -> None:
        if self.inflater is not None:
            chunk = self.inflater.decompress(chunk, self.limit - self.size + 1)
            if self.inflater.unconsumed_tail:
                raise FetchError("too_large", f"decompressed body exceeds {self.limit} bytes")
        self.size += len(chunk)
        if self.size > self.limit:
            raise FetchError("too_large", f"body exceeds {self.limit} bytes")
        self.parts.append(chunk)

    def bytes(self) -> bytes:
        return b"".join(self.parts)


async def _read_exactly(reader: asyncio.StreamReader, size: int, body: _Body) -> None:
    while size > 0:
        chunk = await reader.read(min(size, _CHUNK))
        if not chunk:
            raise asyncio.IncompleteReadError(b"", size)
        size -= len(chunk)
        body.add(chunk)


def tls_context(ca_pem: str | None, verify: bool = True) -> ssl.SSLContext:
    """The client context of an https target: its CA bundle's text, or the system's CAs. Raises ssl.SSLError
    for text that holds no PEM certificate."""
    context = ssl.create_default_context(cadata=ca_pem)
    if not verify:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    return context
