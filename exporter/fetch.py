"""HTTP GET of one target's page: persistent connection, hard deadline, size cap, same-host redirects.

Knows HTTP and nothing of engines. Every failure is a FetchError whose `reason` is one of the
`kvcache_target_scrape_failures_total` reasons.
"""

from __future__ import annotations

import os
import time
import zlib
from dataclasses import dataclass
from urllib.parse import urljoin, urlsplit

import requests
import urllib3.exceptions

# Text 0.0.4 only: prometheus_client ignores q-values and answers OpenMetrics to any Accept that
# names it, and its recent versions then rewrite `vllm:` to `vllm_` on sample lines.
ACCEPT = "text/plain;version=0.0.4"
MAX_REDIRECTS = 3
_CHUNK = 256 * 1024


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
        self.session = requests.Session()
        self.session.headers.update({"Accept": ACCEPT, "Accept-Encoding": "gzip", "User-Agent": "kvcache-exporter"})
        self.session.verify = settings.ca_file or settings.verify_tls
        self.session.trust_env = False  # a fleet on a private network: never route polls through env proxies
        self._token = SecretFile(settings.bearer_token_file) if settings.bearer_token_file else None

    def close(self) -> None:
        self.session.close()

    def fetch(self) -> bytes:
        deadline = time.monotonic() + self.settings.timeout
        headers = {}
        if self._token is not None:
            try:
                headers["Authorization"] = "Bearer " + self._token.read()
            except OSError as err:
                raise FetchError("connect", f"bearer token file: {err.strerror}") from None
        url = self.url
        for _ in range(MAX_REDIRECTS + 1):
            response = self._get(url, headers, deadline)
            if response.is_redirect:
                location = urljoin(url, response.headers.get("Location", ""))
                response.close()
                if urlsplit(location).netloc != urlsplit(self.url).netloc:
                    raise FetchError("http_status", f"redirect to another host refused: {location}")
                url = location
                continue
            if response.status_code != 200:
                response.close()
                raise FetchError("http_status", f"HTTP {response.status_code}")
            return self._read_body(response, deadline)
        raise FetchError("http_status", "too many redirects")

    def _get(self, url: str, headers: dict, deadline: float) -> requests.Response:
        remaining = deadline - time.monotonic()
        try:
            return self.session.get(url, headers=headers, timeout=remaining, stream=True, allow_redirects=False)
        except requests.exceptions.Timeout:
            raise FetchError("timeout", f"no response within {self.settings.timeout:g}s") from None
        except requests.exceptions.RequestException as err:
            raise FetchError("connect", type(err).__name__) from None

    def _read_body(self, response: requests.Response, deadline: float) -> bytes:
        """Read the body within the deadline, decompressing gzip ourselves so that the cap counts
        decompressed bytes and a compression bomb stops at the cap, not in memory."""
        limit = self.settings.max_bytes
        declared = response.headers.get("Content-Length")
        encoding = response.headers.get("Content-Encoding", "identity").lower()
        if encoding == "identity" and declared and declared.isdigit() and int(declared) > limit:
            response.close()
            raise FetchError("too_large", f"Content-Length {declared} exceeds {limit}")
        inflater = zlib.decompressobj(16 + zlib.MAX_WBITS) if encoding == "gzip" else None
        if encoding not in ("identity", "gzip"):
            response.close()
            raise FetchError("parse", f"unsupported Content-Encoding {encoding}")
        raw = response.raw
        sock = getattr(getattr(raw, "connection", None), "sock", None)
        parts: list[bytes] = []
        size = 0
        try:
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise FetchError("timeout", f"body not complete within {self.settings.timeout:g}s")
                if sock is not None:
                    sock.settimeout(remaining)  # read1 does one socket read, so this bounds it
                chunk = raw.read1(_CHUNK, decode_content=False)
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
            response.close()
            raise
        except (TimeoutError, urllib3.exceptions.ReadTimeoutError):
            response.close()
            raise FetchError("timeout", f"body not complete within {self.settings.timeout:g}s") from None
        except zlib.error:
            response.close()
            raise FetchError("parse", "corrupt gzip body") from None
        except (OSError, urllib3.exceptions.HTTPError) as err:
            response.close()
            raise FetchError("connect", f"connection broken: {type(err).__name__}") from None
        return b"".join(parts)

