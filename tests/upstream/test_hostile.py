"""A broken or hostile worker, byte by byte: whatever it writes, a response carries exactly its
own bytes (or fails as malformed), and a connection it wrote out of turn on is never reused, so
nothing it sends can reach another request. Real sockets on loopback, both event loops."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest

from app.config import Settings
from app.errors import UpstreamBadResponse, UpstreamStatusError
from app.upstream import errors as wire
from app.upstream.client import UpstreamClient
from app.upstream.connection import MAX_HEAD_BYTES
from app.upstream.http1 import Http1Client
from app.workers.worker import Worker
from tests.upstream.fakes import Handler, Server, Start, body_of, fixed, post

OK = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"
STRAY = b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nSTRAY"


def numbered(extra: bytes) -> Callable[[Server], Handler]:
    """Answers request n with ``#n``; the first answer is followed by ``extra`` bytes."""

    def make(server: Server) -> Handler:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            while True:
                await server.request(reader)
                n = len(server.requests)
                answer = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n#%d" % n
                writer.write(answer + (extra if n == 1 else b""))
                await writer.drain()

        return handle

    return make


def watch_loop() -> list[dict[str, Any]]:
    """What reaches the event loop's exception handler ("Fatal error on transport"...)."""
    seen: list[dict[str, Any]] = []
    asyncio.get_running_loop().set_exception_handler(lambda loop, ctx: seen.append(ctx))
    return seen


# Bytes after the end of a response (item: the pooled connection is never poisoned).


@pytest.mark.parametrize(
    "extra",
    [STRAY, b"HTTP/1.1 200 OK\r\n", b"garbage"],
    ids=["a-whole-second-response", "a-partial-head", "garbage"],
)
async def test_bytes_after_a_response_reach_no_request(
    serve: Start, client: Http1Client, extra: bytes
) -> None:
    server = await serve(numbered(extra))
    first = await client.request("127.0.0.1", server.port, post(server.port))
    assert first.status_code == 200
    assert await body_of(first) == b"#1"  # exactly its own body
    await first.aclose()
    second = await client.request("127.0.0.1", server.port, post(server.port))
    assert second.status_code == 200
    assert await body_of(second) == b"#2"
    await second.aclose()
    assert server.connections == 2  # the first connection was not reused


async def test_a_whole_read_with_bytes_after_the_response_fails_as_malformed(
    serve: Start, client: Http1Client
) -> None:
    """Read whole, a response the worker framed shorter than what it sent is not trusted: it
    may be a truncated one (a Content-Length shorter than the body)."""
    server = await serve(fixed(b'HTTP/1.1 200 OK\r\ncontent-length: 7\r\n\r\n{"a":1}{"b":2}'))
    response = await client.request("127.0.0.1", server.port, post(server.port))
    with pytest.raises(wire.MalformedResponse):
        await response.aread()
    assert client.idle_connections("127.0.0.1", server.port) == 0


async def test_a_late_stray_response_never_reaches_the_next_request(
    serve: Start, client: Http1Client
) -> None:
    """The worker answers, then (while the answer is still held, not yet read) sends another
    response nobody asked for. The held response keeps its own body; the next request gets its
    own answer on a fresh connection."""
    send_stray = asyncio.Event()
    hung_up = asyncio.Event()

    def make(server: Server) -> Handler:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await server.request(reader)
            writer.write(OK)
            await send_stray.wait()
            writer.write(STRAY)
            await writer.drain()
            if await reader.read() == b"":  # the client hung up on this connection
                hung_up.set()

        return handle

    server = await serve(make)
    first = await client.request("127.0.0.1", server.port, post(server.port))
    send_stray.set()

    async def stray_arrived() -> None:
        while first.buffered <= 2 and not hung_up.is_set():
            await asyncio.sleep(0.005)

    await asyncio.wait_for(stray_arrived(), 10)
    assert await body_of(first) == b"ok"
    await first.aclose()
    assert client.idle_connections("127.0.0.1", server.port) == 0
    other = await serve(fixed(OK))
    assert await body_of(await client.request("127.0.0.1", other.port, post(other.port))) == b"ok"
    assert server.connections == 1


async def test_bytes_on_an_idle_connection_close_it(serve: Start, client: Http1Client) -> None:
    def make(server: Server) -> Handler:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            while True:
                await server.request(reader)
                writer.write(OK)
                await writer.drain()
                if len(server.requests) == 1:
                    await asyncio.sleep(0.05)  # the client has pooled the connection by now
                    writer.write(STRAY)
                    await writer.drain()

        return handle

    server = await serve(make)
    response = await client.request("127.0.0.1", server.port, post(server.port))
    assert await body_of(response) == b"ok"
    for _ in range(500):
        if not client.idle_connections("127.0.0.1", server.port):
            break
        await asyncio.sleep(0.01)
    again = await client.request("127.0.0.1", server.port, post(server.port))
    assert await body_of(again) == b"ok"
    assert server.connections == 2


# Responses the gateway does not accept: a clean error, never an escaped exception.


async def test_a_protocol_switch_is_a_malformed_response(serve: Start, client: Http1Client) -> None:
    loop_errors = watch_loop()
    server = await serve(
        fixed(
            b"HTTP/1.1 101 Switching Protocols\r\nupgrade: websocket\r\n"
            b"connection: upgrade\r\n\r\n\x81\x05hello"
        )
    )
    with pytest.raises(wire.MalformedResponse, match="switched protocols"):
        await client.request("127.0.0.1", server.port, post(server.port))
    await asyncio.sleep(0)
    assert loop_errors == []
    assert client.idle_connections("127.0.0.1", server.port) == 0


class HugeHead:
    """A worker whose response head never ends: one header value of ``total`` bytes, written
    as fast as its peer reads. Notes whether the peer hung up before it was all sent."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.sent = 0
        self.cut_off = asyncio.Event()

    def __call__(self, server: Server) -> Handler:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await server.request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\nx-big: ")
            piece = b"a" * 65536
            try:
                while self.sent < self.total:
                    writer.write(piece)
                    self.sent += len(piece)
                    await writer.drain()
                writer.write(b"\r\ncontent-length: 2\r\n\r\nok")
                await writer.drain()
            except ConnectionError:
                self.cut_off.set()
                raise

        return handle


async def test_a_response_head_over_the_cap_is_refused_as_it_arrives(
    serve: Start, client: Http1Client
) -> None:
    huge = HugeHead(20 * 1024 * 1024)
    server = await serve(huge)
    with pytest.raises(wire.MalformedResponse, match="head over"):
        await client.request("127.0.0.1", server.port, post(server.port))
    await asyncio.wait_for(huge.cut_off.wait(), 30)
    assert huge.sent < huge.total  # the client stopped reading long before the end


@pytest.mark.parametrize(("count", "accepted"), [(600, True), (700, False)])
async def test_many_headers_in_one_read_count_against_the_cap(
    serve: Start, client: Http1Client, count: int, accepted: bool
) -> None:
    fields = b"".join(b"x-h%05d: %s\r\n" % (i, b"v" * 90) for i in range(count))  # 102 B each
    assert (len(fields) <= MAX_HEAD_BYTES) is accepted
    server = await serve(fixed(b"HTTP/1.1 200 OK\r\n" + fields + b"content-length: 2\r\n\r\nok"))
    if accepted:
        response = await client.request("127.0.0.1", server.port, post(server.port))
        assert await response.aread() == b"ok"
    else:
        with pytest.raises(wire.MalformedResponse, match="head over"):
            await client.request("127.0.0.1", server.port, post(server.port))


# Through UpstreamClient: what the gateway makes of it.


async def test_upstream_client_maps_bad_responses(serve: Start) -> None:
    client = UpstreamClient(Settings())
    try:
        for answer in (
            b"HTTP/1.1 101 Switching Protocols\r\nupgrade: h2c\r\nconnection: upgrade\r\n\r\n",
            b"HTTP/1.1 302 Found\r\nlocation: http://elsewhere/\r\ncontent-length: 0\r\n\r\n",
            b"HTTP/1.1 200 OK\r\ncontent-length: nope\r\n\r\n",
        ):
            server = await serve(fixed(answer))
            worker = Worker(f"http://127.0.0.1:{server.port}")
            with pytest.raises(UpstreamBadResponse) as info:
                await client.open(worker, "/v1/chat/completions", b"{}", [])
            assert info.value.status == 502 and info.value.retryable
            assert info.value.body()["error"]["code"] == "bad_upstream_response"
    finally:
        await client.aclose()


async def test_control_call_answers_are_capped(serve: Start) -> None:
    big = b'{"data":"' + b"x" * (2 * 1024 * 1024) + b'"}'
    server = await serve(
        fixed(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(big), big))
    )
    client = UpstreamClient(Settings())
    try:
        with pytest.raises(UpstreamBadResponse):
            await client.get(Worker(f"http://127.0.0.1:{server.port}"), "/v1/models", 5.0)
    finally:
        await client.aclose()


async def test_worker_error_status_is_rewrapped_in_openai_shape(serve: Start) -> None:
    error = (
        b'{"object":"error","message":"The input (9000 tokens) is longer than the model\'s '
        b'context length (8192 tokens).","type":"BadRequestError","param":null,"code":400}'
    )
    server = await serve(
        fixed(b"HTTP/1.1 400 Bad Request\r\ncontent-length: %d\r\n\r\n%s" % (len(error), error))
    )
    client = UpstreamClient(Settings())
    try:
        with pytest.raises(UpstreamStatusError) as info:
            await client.open(Worker(f"http://127.0.0.1:{server.port}"), "/x", b"{}", [])
    finally:
        await client.aclose()
    body = info.value.body()["error"]
    assert info.value.status == 400
    assert body == {
        "message": "The input (9000 tokens) is longer than the model's context length "
        "(8192 tokens).",
        "type": "invalid_request_error",
        "param": None,
        "code": "context_length_exceeded",
    }
