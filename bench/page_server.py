"""A fast local server for the benchmarks: N engine pages on one port, at /t/<i>, changing between polls.

    python -m bench.page_server --port P --pages vllm-v1.txt,sglang-0.5.txt

Pages are pre-rendered (several variants of each, with other values) so that serving costs a
dictionary look-up and a write: the exporter and Prometheus are what the benchmark measures.
Target i serves the (i mod number of pages)-th page, the next variant at every request.
"""

from __future__ import annotations

import argparse
import asyncio
import re
from pathlib import Path

FIXTURES = Path(__file__).resolve().parents[1] / "tests" / "fixtures"
VARIANTS = 8
_NUMBER = re.compile(r"(?<=\} )(\d+(?:\.\d+)?(?:e[+-]\d+)?)$", re.MULTILINE)


def variant(text: str, index: int) -> str:
    """`text` with every sample value above 1 scaled by 1 + index/1000 (counters grow with the index)."""
    scale = 1.0 + index / 1000

    def bump(match: re.Match) -> str:
        value = float(match.group(1))
        return repr(value * scale) if value > 1 else match.group(1)

    return _NUMBER.sub(bump, text)


def variants(text: str, count: int = VARIANTS) -> list[bytes]:
    """`count` pages like `text` whose sample values grow from one variant to the next (counters stay monotonic)."""
    return [variant(text, index).encode() for index in range(count)]


def response(body: bytes) -> bytes:
    return (b"HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4; charset=utf-8\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body)) + body


async def serve(port: int, pages: list[list[bytes]]) -> None:
    prepared = [[response(body) for body in page] for page in pages]
    counters: dict[int, int] = {}

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                path = head.split(b" ", 2)[1]
                index = int(path.rsplit(b"/", 1)[1]) if path.startswith(b"/t/") else 0
                turn = counters.get(index, 0)
                counters[index] = turn + 1
                page = prepared[index % len(prepared)]
                writer.write(page[turn % len(page)])
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, ValueError, IndexError):
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", port, backlog=4096)
    async with server:
        await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--pages", default="vllm-v1.txt")
    args = parser.parse_args()
    pages = [variants((FIXTURES / name).read_text()) for name in args.pages.split(",")]
    asyncio.run(serve(args.port, pages))


if __name__ == "__main__":
    main()
