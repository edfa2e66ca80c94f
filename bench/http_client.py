"""CPU per GET of the same engine page over a kept-alive connection, by HTTP client:

    python -m bench.http_client [--requests 2000] [--page vllm-v1-35k]

requests.Session, urllib3, http.client, a bare asyncio stream and the exporter's own Fetcher
(asyncio streams plus its deadline, size cap and gzip handling) each fetch the page from the
benchmark's page server (a separate process, so only the client's CPU is counted). The figure is
this process' CPU time per request, the best of a few rounds. The two asyncio clients start the
event loop once per request (run_until_complete), which the exporter, awaiting inside its running
loop, does not: their figures are upper bounds.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import http.client
import sys
import tempfile
from pathlib import Path
from typing import Callable, Iterator

import requests
import urllib3

from kvcache_exporter.sources.fetch import ACCEPT, Fetcher, FetchSettings

from . import pages
from .fleet import Fleet
from bench.parser_speed import best_of

HEADERS = {"Accept": ACCEPT, "Accept-Encoding": "gzip", "User-Agent": "bench"}


Get = Callable[[], bytes]


@contextlib.contextmanager
def requests_client(url: str) -> Iterator[Get]:
    with requests.Session() as session:
        yield lambda: session.get(url, headers=HEADERS, timeout=4).content


@contextlib.contextmanager
def urllib3_client(url: str) -> Iterator[Get]:
    with urllib3.PoolManager(maxsize=1, timeout=4.0) as pool:
        yield lambda: pool.request("GET", url, headers=HEADERS).data


@contextlib.contextmanager
def http_client(url: str) -> Iterator[Get]:
    parts = urllib3.util.parse_url(url)
    connection = http.client.HTTPConnection(parts.host, parts.port, timeout=4)

    def get() -> bytes:
        connection.request("GET", parts.path, headers=HEADERS)
        return connection.getresponse().read()

    try:
        yield get
    finally:
        connection.close()


@contextlib.contextmanager
def asyncio_stream(url: str) -> Iterator[Get]:
    """The least an asyncio client does: write the request, read the head, read Content-Length bytes."""
    parts = urllib3.util.parse_url(url)
    loop = asyncio.new_event_loop()
    reader, writer = loop.run_until_complete(asyncio.open_connection(parts.host, parts.port))
    request = (f"GET {parts.path} HTTP/1.1\r\nHost: {parts.netloc}\r\n"
               + "".join(f"{k}: {v}\r\n" for k, v in HEADERS.items()) + "\r\n").encode()

    async def get() -> bytes:
        writer.write(request)
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(head.lower().split(b"content-length:", 1)[1].split(b"\r\n", 1)[0])
        return await reader.readexactly(length)

    try:
        yield lambda: loop.run_until_complete(get())
    finally:
        writer.close()
        loop.run_until_complete(asyncio.sleep(0))
        loop.close()


@contextlib.contextmanager
def exporter_fetcher(url: str) -> Iterator[Get]:
    loop = asyncio.new_event_loop()
    fetcher = Fetcher(url, FetchSettings(timeout=4.0, max_bytes=16 * 1024 * 1024))
    try:
        yield lambda: loop.run_until_complete(fetcher.fetch())
    finally:
        fetcher.close()
        loop.run_until_complete(asyncio.sleep(0))
        loop.close()


CLIENTS = {"requests.Session": requests_client, "urllib3": urllib3_client, "http.client": http_client,
           "asyncio stream": asyncio_stream, "exporter Fetcher": exporter_fetcher}


def cpu_per_request(get: Get, count: int, rounds: int = 3) -> float:
    """CPU seconds of this process per call, the best of `rounds` rounds of `count` calls."""
    get()  # connect outside the timing
    return best_of(get, rounds, count)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.http_client", description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=2000, help="requests per round and client")
    p.add_argument("--page", default="vllm-v1-35k", choices=sorted(pages.PAGES))
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as scratch:
        paths = pages.write_pages(Path(scratch))
        lines = paths[args.page].read_text().count("\n")  # variants differ in values, not in lines
        with Fleet("http-client", [paths[args.page]], Path(scratch)) as fleet:
            url = fleet.url(0)
            print(f"GET of {args.page} ({paths[args.page].stat().st_size / 1000:.0f} KB) over a kept-alive "
                  "connection, CPU of the client:")
            baseline = None
            for name, client in CLIENTS.items():
                with client(url) as get:
                    if get().count(b"\n") != lines:
                        raise SystemExit(f"{name} did not read the whole page")
                    micros = cpu_per_request(get, args.requests) * 1e6
                baseline = baseline or micros
                print(f"  {name:18} {micros:7.0f} µs per request  ({micros / baseline:4.2f} of requests.Session's)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
