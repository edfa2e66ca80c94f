"""exporter.sources.fetch against a raw HTTP server in the same event loop: framing, reuse, errors."""

from __future__ import annotations

import asyncio
import gzip

import pytest

from kvcache_exporter.sources.fetch import Fetcher, FetchError, FetchSettings

PAGE = b"# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 3\n"


def serve(responses: list[bytes], close_after_each: bool = False):
    """Run `fetches(url)` against a server that answers the requests it gets with `responses` in order;
    returns what the coroutine returned and how many connections the server saw."""
    async def run(fetches):
        connections = 0
        queue = list(responses)

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            nonlocal connections
            connections += 1
            try:
                while queue:
                    await reader.readuntil(b"\r\n\r\n")
                    writer.write(queue.pop(0))
                    await writer.drain()
                    if close_after_each:
                        break
            except (asyncio.IncompleteReadError, ConnectionError):
                pass
            finally:
                writer.close()

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        try:
            result = await fetches(f"http://127.0.0.1:{port}/metrics")
        finally:
            server.close()
            await asyncio.sleep(0.05)  # the handlers see the client go and close their ends
        return result, connections

    return run


def fetcher(url: str, **settings) -> Fetcher:
    return Fetcher(url, FetchSettings(**{"timeout": 2.0, "max_bytes": 1 << 20, **settings}))


async def fetch_times(url: str, times: int, **settings) -> list[bytes]:
    client = fetcher(url, **settings)
    try:
        return [await client.fetch() for _ in range(times)]
    finally:
        client.close()
        await asyncio.sleep(0)  # the transport closes in the next turn of the loop


def response(body: bytes, *headers: str, status: str = "200 OK", version: str = "HTTP/1.1") -> bytes:
    return (f"{version} {status}\r\n" + "".join(h + "\r\n" for h in headers) + "\r\n").encode() + body


def length(body: bytes) -> str:
    return f"Content-Length: {len(body)}"


def test_a_kept_alive_connection_serves_every_poll():
    bodies, connections = asyncio.run(serve([response(PAGE, length(PAGE))] * 3)(lambda url: fetch_times(url, 3)))
    assert bodies == [PAGE] * 3
    assert connections == 1


def test_a_connection_the_target_closed_meanwhile_is_replaced_once():
    run = serve([response(PAGE, length(PAGE))] * 2, close_after_each=True)
    bodies, connections = asyncio.run(run(lambda url: fetch_times(url, 2)))
    assert bodies == [PAGE] * 2
    assert connections == 2


def test_chunked_bodies_with_extensions_and_trailers():
    chunked = b"%x;ext=1\r\n%s\r\n%x\r\n%s\r\n0\r\nX-Trailer: 1\r\n\r\n" % (10, PAGE[:10], len(PAGE) - 10, PAGE[10:])
    (body,), _ = asyncio.run(serve([response(chunked, "Transfer-Encoding: chunked")])(lambda url: fetch_times(url, 1)))
    assert body == PAGE


def test_a_body_without_framing_ends_when_the_target_closes():
    run = serve([response(PAGE, version="HTTP/1.0")], close_after_each=True)
    (body,), _ = asyncio.run(run(lambda url: fetch_times(url, 1)))
    assert body == PAGE


def test_gzip_is_inflated_and_capped_after_inflation():
    packed = gzip.compress(PAGE * 100)
    ok = response(packed, length(packed), "Content-Encoding: gzip")
    (body,), _ = asyncio.run(serve([ok])(lambda url: fetch_times(url, 1)))
    assert body == PAGE * 100
    with pytest.raises(FetchError) as failed:
        asyncio.run(serve([ok])(lambda url: fetch_times(url, 1, max_bytes=len(PAGE) * 10)))
    assert failed.value.reason == "too_large"


@pytest.mark.parametrize("raw, reason", [
    (response(b"no", "Content-Length: 2", status="503 Service Unavailable"), "http_status"),
    (response(b"", "Location: http://elsewhere.example/metrics", "Content-Length: 0", status="302 Found"),
     "http_status"),
    (response(PAGE, "Content-Length: 9999999"), "too_large"),
    (response(PAGE, "Content-Length: many"), "connect"),
    (response(PAGE, length(PAGE), "Content-Encoding: br"), "parse"),
    (b"SSH-2.0-OpenSSH_9.2\r\n\r\n", "connect"),
    (response(b"zz\r\n", "Transfer-Encoding: chunked"), "connect"),
])
def test_bad_responses_fail_with_their_reason(raw, reason):
    with pytest.raises(FetchError) as failed:
        asyncio.run(serve([raw])(lambda url: fetch_times(url, 1, max_bytes=4096)))
    assert failed.value.reason == reason


def failure_against(handler) -> str:
    """The failure reason of a fetch with a 0.3 s deadline from a server that answers with `handler`."""
    async def run():
        server = await asyncio.start_server(handler, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        try:
            return await fetch_times(f"http://127.0.0.1:{port}/metrics", 1, timeout=0.3)
        finally:
            server.close()
            await asyncio.sleep(0.05)

    with pytest.raises(FetchError) as failed:
        asyncio.run(run())
    return failed.value.reason


def test_a_target_that_never_answers_times_out_at_the_deadline():
    async def hold(reader, writer):
        await reader.read()  # until the client gives up and closes
        writer.close()

    assert failure_against(hold) == "timeout"


def test_a_head_trickled_byte_by_byte_times_out_at_the_deadline():
    async def drip(reader, writer):
        await reader.readuntil(b"\r\n\r\n")
        try:
            for byte in response(PAGE, length(PAGE)):  # 3 s at this pace; the deadline is 0.3 s
                writer.write(bytes([byte]))
                await writer.drain()
                await asyncio.sleep(0.02)
        except ConnectionError:
            pass
        finally:
            writer.close()

    assert failure_against(drip) == "timeout"


def test_a_credentials_file_with_a_line_break_sends_nothing(tmp_path):
    token = tmp_path / "token"
    token.write_text("abc\r\nX-Injected: 1\n")
    with pytest.raises(FetchError) as failed:
        asyncio.run(fetch_times("http://127.0.0.1:9/metrics", 1, bearer_token_file=str(token)))
    assert failed.value.reason == "credentials" and f"{token} holds a line break" == failed.value.detail


def test_a_missing_credentials_file_is_a_credentials_failure_that_names_the_file(tmp_path):
    missing = tmp_path / "no-such-token"
    with pytest.raises(FetchError) as failed:
        asyncio.run(fetch_times("http://127.0.0.1:9/metrics", 1, bearer_token_file=str(missing)))
    assert failed.value.reason == "credentials"
    assert failed.value.detail == f"cannot read {missing}: No such file or directory"


@pytest.mark.parametrize("content, problem", [(b"", "is empty"), (b" \n", "is empty"),
                                               (b"\xff\xfe", "is not UTF-8 text")])
def test_a_credentials_file_emptied_or_garbled_after_load_sends_nothing(tmp_path, content, problem):
    """The configuration refuses such a file at load; one that becomes so while the exporter runs is a failure too."""
    token = tmp_path / "token"
    token.write_bytes(content)
    with pytest.raises(FetchError) as failed:
        asyncio.run(fetch_times("http://127.0.0.1:9/metrics", 1, bearer_token_file=str(token)))
    assert (failed.value.reason, failed.value.detail) == ("credentials", f"{token} {problem}")
