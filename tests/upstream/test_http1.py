"""Http1Client (the HTTP/1.1 client of every worker call) against small HTTP servers on loopback.

Each server is a real asyncio server that speaks raw HTTP/1.1, so framing (chunked,
Content-Length, until-close), keep-alive reuse, connections dropped mid-response, silent servers
and TCP backpressure are all exercised on real sockets, on asyncio's loop and on uvloop (the
gateway's; see conftest.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket

import pytest

from app.config import Settings
from app.errors import UpstreamConnectError, UpstreamStatusError, UpstreamTimeout
from app.upstream import errors as wire
from app.upstream.client import UpstreamClient
from app.upstream.connection import HIGH_WATER
from app.upstream.http1 import Http1Client
from app.workers.worker import Worker
from tests.upstream.fakes import (
    SSE,
    SSE_HEAD,
    Handler,
    Server,
    Start,
    body_of,
    fixed,
    keepalive_sse,
    post,
)


async def test_chunked_stream_and_keep_alive_reuse(serve: Start, client: Http1Client) -> None:
    server = await serve(keepalive_sse)
    for _ in range(3):
        response = await client.request("127.0.0.1", server.port, post(server.port, b'{"a":1}'))
        assert response.status_code == 200
        assert response.headers["content-type"] == "text/event-stream"
        assert await body_of(response) == b"".join(SSE)
        await response.aclose()
    assert server.connections == 1
    head, body = server.requests[0]
    assert head.startswith(b"POST /x HTTP/1.1\r\n")
    assert body == b'{"a":1}'


async def test_content_length_body(serve: Start, client: Http1Client) -> None:
    server = await serve(
        fixed(b"HTTP/1.1 200 OK\r\ncontent-length: 11\r\nX-Thing: A\r\n\r\nhello world")
    )
    for _ in range(2):
        response = await client.request("127.0.0.1", server.port, post(server.port))
        assert await response.aread() == b"hello world"
        assert response.headers["x-thing"] == "A"
        await response.aclose()
    assert server.connections == 1


async def test_body_split_across_many_writes(serve: Start, client: Http1Client) -> None:
    payload = bytes(range(256)) * 400

    def make(server: Server) -> Handler:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await server.request(reader)
            raw = b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % len(payload) + payload
            for i in range(0, len(raw), 777):  # framing bytes split anywhere
                writer.write(raw[i : i + 777])
                await writer.drain()
            await reader.read()

        return handle

    server = await serve(make)
    response = await client.request("127.0.0.1", server.port, post(server.port))
    assert await response.aread() == payload


async def test_until_close_body_is_read_to_eof_and_not_reused(
    serve: Start, client: Http1Client
) -> None:
    server = await serve(
        fixed(b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\n\r\nall of it", keep=False)
    )
    for _ in range(2):
        response = await client.request("127.0.0.1", server.port, post(server.port))
        assert await response.aread() == b"all of it"
        await response.aclose()
    assert server.connections == 2


async def test_interim_response_is_skipped(serve: Start, client: Http1Client) -> None:
    server = await serve(
        fixed(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 201 Created\r\ncontent-length: 2\r\n\r\nok")
    )
    response = await client.request("127.0.0.1", server.port, post(server.port))
    assert response.status_code == 201
    assert await response.aread() == b"ok"


async def test_connection_close_response_is_not_reused(serve: Start, client: Http1Client) -> None:
    server = await serve(
        fixed(b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 2\r\n\r\nok", keep=False)
    )
    for _ in range(2):
        response = await client.request("127.0.0.1", server.port, post(server.port))
        assert await response.aread() == b"ok"
        await response.aclose()
    assert server.connections == 2


async def test_an_idle_connection_the_server_closed_is_not_reused(
    serve: Start, client: Http1Client
) -> None:
    def make(server: Server) -> Handler:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await server.request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
            await writer.drain()
            # then close the kept-alive connection (the handler returns)

        return handle

    server = await serve(make)
    for _ in range(3):
        response = await client.request("127.0.0.1", server.port, post(server.port))
        assert await response.aread() == b"ok"
        await response.aclose()
        for _ in range(200):  # the server's FIN reaches the idle connection
            if not client.idle_connections("127.0.0.1", server.port):
                break
            await asyncio.sleep(0.01)
        assert client.idle_connections("127.0.0.1", server.port) == 0
    assert server.connections == 3


async def test_keep_alive_expiry(serve: Start) -> None:
    now = [0.0]
    client = Http1Client(connect_s=2.0, keepalive_s=4.0, clock=lambda: now[0])
    try:
        server = await serve(fixed(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"))
        for step in (0.0, 3.0, 5.0):  # reused after 3 s idle; not after 5 s more
            now[0] += step
            response = await client.request("127.0.0.1", server.port, post(server.port))
            assert await response.aread() == b"ok"
            await response.aclose()
        assert server.connections == 2
    finally:
        await client.aclose()


async def test_server_closing_mid_response(serve: Start, client: Http1Client) -> None:
    def make(server: Server) -> Handler:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await server.request(reader)
            writer.write(SSE_HEAD + b"9\r\ndata: 1\n\n\r\n")
            await writer.drain()  # and close, without the rest

        return handle

    server = await serve(make)
    response = await client.request("127.0.0.1", server.port, post(server.port))
    chunks = response.aiter_raw()
    assert await chunks.__anext__() == b"data: 1\n\n"
    with pytest.raises(wire.ConnectionLost):
        await chunks.__anext__()
    await response.aclose()
    assert client.idle_connections("127.0.0.1", server.port) == 0


async def test_server_closing_before_answering(serve: Start, client: Http1Client) -> None:
    def make(server: Server) -> Handler:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await server.request(reader)

        return handle

    server = await serve(make)
    with pytest.raises(wire.ConnectionLost):
        await client.request("127.0.0.1", server.port, post(server.port))


async def test_malformed_response(serve: Start, client: Http1Client) -> None:
    server = await serve(fixed(b"HTTP/1.1 200 OK\r\ncontent-length: nope\r\n\r\n"))
    with pytest.raises(wire.MalformedResponse):
        await client.request("127.0.0.1", server.port, post(server.port))


async def test_connection_refused(client: Http1Client) -> None:
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        with pytest.raises(wire.ConnectFailed):
            await client.request("127.0.0.1", port, post(port))


async def test_server_that_never_answers(serve: Start, client: Http1Client) -> None:
    def make(server: Server) -> Handler:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await server.request(reader)
            await asyncio.Event().wait()

        return handle

    server = await serve(make)
    with pytest.raises(wire.ReadTimeout):
        await client.request("127.0.0.1", server.port, post(server.port), first_byte_s=0.05)
    assert client.idle_connections("127.0.0.1", server.port) == 0


async def test_server_that_goes_silent_mid_stream(serve: Start, client: Http1Client) -> None:
    def make(server: Server) -> Handler:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await server.request(reader)
            writer.write(SSE_HEAD + b"9\r\ndata: 1\n\n\r\n")
            await writer.drain()
            await asyncio.Event().wait()

        return handle

    server = await serve(make)
    response = await client.request("127.0.0.1", server.port, post(server.port), idle_s=0.05)
    chunks = response.aiter_raw()
    assert await chunks.__anext__() == b"data: 1\n\n"
    with pytest.raises(wire.ReadTimeout):
        await chunks.__anext__()


async def test_connect_timeout() -> None:
    # A listener whose accept queue is full and never drained: further SYNs go unanswered.
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)
        port = listener.getsockname()[1]
        fillers: list[socket.socket] = []
        try:
            for _ in range(8):
                s = socket.socket()
                s.setblocking(False)
                with contextlib.suppress(BlockingIOError):
                    s.connect(("127.0.0.1", port))
                fillers.append(s)
            client = Http1Client(connect_s=0.2)
            try:
                with pytest.raises(wire.ConnectTimeout):
                    await client.request("127.0.0.1", port, post(port))
            finally:
                await client.aclose()
        finally:
            for s in fillers:
                s.close()


async def test_abandoned_response_closes_its_connection(serve: Start, client: Http1Client) -> None:
    server = await serve(keepalive_sse)
    response = await client.request("127.0.0.1", server.port, post(server.port))
    await response.aclose()  # nothing read
    response = await client.request("127.0.0.1", server.port, post(server.port))
    assert await body_of(response) == b"".join(SSE)
    assert server.connections == 2


async def test_cancelled_while_waiting_for_headers(serve: Start, client: Http1Client) -> None:
    answered = asyncio.Event()

    def make(server: Server) -> Handler:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await server.request(reader)
            answered.set()
            await reader.read()  # until the client hangs up

        return handle

    server = await serve(make)
    task = asyncio.create_task(client.request("127.0.0.1", server.port, post(server.port)))
    await answered.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert client.idle_connections("127.0.0.1", server.port) == 0


PIECE = bytes(range(256)) * 256  # 64 KiB


class Flood:
    """A server that sends ``total`` bytes of ``PIECE`` as fast as its peer reads them, and
    notes when its peer has stopped reading (its own buffer past 4 MiB: the kernel's are full)."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.sent = 0
        self.blocked = asyncio.Event()

    def __call__(self, server: Server) -> Handler:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await server.request(reader)
            writer.transport.set_write_buffer_limits(high=8 * 1024 * 1024)
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % self.total)
            while self.sent < self.total:
                writer.write(PIECE)
                self.sent += len(PIECE)
                if writer.transport.get_write_buffer_size() > 4 * 1024 * 1024:
                    self.blocked.set()
                await writer.drain()

        return handle


async def test_slow_reader_backpressure_bounds_memory(serve: Start, client: Http1Client) -> None:
    """A reader that stops reading stops the socket being read: the server's own buffer fills
    up (it cannot send everything), the client holds at most a high-water mark plus one read,
    and reading on delivers every byte in order."""
    total = 32 * 1024 * 1024
    piece = PIECE
    flood = Flood(total)
    server = await serve(flood)
    response = await client.request("127.0.0.1", server.port, post(server.port))
    chunks = response.aiter_raw()
    received = await chunks.__anext__()
    await asyncio.wait_for(flood.blocked.wait(), 30)
    assert response.buffered <= HIGH_WATER + 256 * 1024
    assert flood.sent < total
    got = len(received)
    ok = received == (piece * (len(received) // len(piece) + 1))[: len(received)]
    async for part in chunks:
        expect_at = got % len(piece)
        window = (piece * (len(part) // len(piece) + 2))[expect_at : expect_at + len(part)]
        ok = ok and part == window
        got += len(part)
    assert got == total
    assert ok


# pump(): the body handed to a callback from the read callback (the committed stream's relay).


async def test_pump_delivers_the_body_in_order_and_reuses_the_connection(
    serve: Start, client: Http1Client
) -> None:
    server = await serve(keepalive_sse)
    for _ in range(2):
        response = await client.request("127.0.0.1", server.port, post(server.port))
        got: list[bytes] = []

        def sink(data: bytes, got: list[bytes] = got) -> bool:
            got.append(data)
            return False

        await response.pump(sink, _never_called)
        assert b"".join(got) == b"".join(SSE)
        assert client.idle_connections("127.0.0.1", server.port) == 1
    assert server.connections == 1


async def _never_called() -> None:
    raise AssertionError("drain() without backpressure")


async def test_pump_pauses_reading_while_the_consumer_is_behind(
    serve: Start, client: Http1Client
) -> None:
    """A sink that reports its consumer behind stops the socket being read until drain()
    returns; every byte still arrives, in order, and nothing piles up in the gateway."""
    total = 16 * 1024 * 1024
    flood = Flood(total)
    server = await serve(flood)
    response = await client.request("127.0.0.1", server.port, post(server.port))
    received = bytearray()
    behind = [True]  # the consumer starts out behind and catches up only when told
    drains = [0]
    caught_up = asyncio.Event()

    def sink(data: bytes) -> bool:
        received.extend(data)
        return behind[0]

    async def drain() -> None:
        drains[0] += 1
        await caught_up.wait()

    pumping = asyncio.create_task(response.pump(sink, drain))
    await asyncio.wait_for(flood.blocked.wait(), 30)
    assert flood.sent < total
    assert len(received) <= 1024 * 1024  # one read at most: the socket was not read on
    behind[0] = False
    caught_up.set()
    await asyncio.wait_for(pumping, 30)
    assert drains[0] == 1
    assert len(received) == total
    assert bytes(received) == PIECE * (total // len(PIECE))


async def test_pump_raises_a_connection_dropped_mid_body(serve: Start, client: Http1Client) -> None:
    def make(server: Server) -> Handler:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await server.request(reader)
            writer.write(SSE_HEAD + b"9\r\ndata: 1\n\n\r\n")
            await writer.drain()
            await asyncio.sleep(0.05)  # then close, without the rest

        return handle

    server = await serve(make)
    response = await client.request("127.0.0.1", server.port, post(server.port))
    got: list[bytes] = []
    with pytest.raises(wire.ConnectionLost):
        await response.pump(lambda data: got.append(data) is not None, _never_called)
    assert got == [b"data: 1\n\n"]
    assert client.idle_connections("127.0.0.1", server.port) == 0


async def test_pump_raises_what_the_sink_raised_and_drops_the_connection(
    serve: Start, client: Http1Client
) -> None:
    server = await serve(keepalive_sse)
    response = await client.request("127.0.0.1", server.port, post(server.port))

    def sink(data: bytes) -> bool:
        raise RuntimeError("consumer failed")

    with pytest.raises(RuntimeError, match="consumer failed"):
        await response.pump(sink, _never_called)
    await response.aclose()
    assert client.idle_connections("127.0.0.1", server.port) == 0


async def test_pump_raises_a_sink_failure_on_the_read_that_ends_the_body(
    serve: Start, client: Http1Client
) -> None:
    """The last event and the end of the body in one read: the sink's failure there must not
    pass for a body relayed to the end (that event never reached the client)."""

    def make(server: Server) -> Handler:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await server.request(reader)
            writer.write(SSE_HEAD + b"9\r\ndata: 1\n\n\r\n")
            await writer.drain()
            await asyncio.sleep(0.05)
            writer.write(b"c\r\ndata: last\n\n\r\n0\r\n\r\n")
            await writer.drain()
            await asyncio.sleep(0.5)

        return handle

    server = await serve(make)
    response = await client.request("127.0.0.1", server.port, post(server.port))

    def sink(data: bytes) -> bool:
        if b"last" in data:
            raise RuntimeError("client gone")
        return False

    with pytest.raises(RuntimeError, match="client gone"):
        await response.pump(sink, _never_called)
    assert client.idle_connections("127.0.0.1", server.port) == 0


# Through UpstreamClient: the request head it writes and its errors in the gateway's terms.


def upstream(settings: Settings | None = None) -> UpstreamClient:
    return UpstreamClient(settings or Settings())


async def test_upstream_client_request_head(serve: Start) -> None:
    server = await serve(
        fixed(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}")
    )
    client = upstream(Settings(worker_api_key="sk-worker"))
    try:
        worker = Worker(f"http://127.0.0.1:{server.port}")
        headers = [(b"x-request-id", b"abc"), (b"traceparent", b"00-1-2-01")]
        response = await client.open(worker, "/v1/chat/completions", b'{"q":1}', headers)
        assert await response.aread() == b"{}"
        await response.aclose()
    finally:
        await client.aclose()
    head, body = server.requests[0]
    lines = head.decode().split("\r\n")
    assert lines[0] == "POST /v1/chat/completions HTTP/1.1"
    fields = {k.lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:] if line)}
    assert fields == {
        "host": f"127.0.0.1:{server.port}",
        "accept-encoding": "identity",
        "content-type": "application/json",
        "authorization": "Bearer sk-worker",
        "content-length": "7",
        "x-request-id": "abc",
        "traceparent": "00-1-2-01",
    }
    assert body == b'{"q":1}'


async def test_upstream_client_maps_errors(serve: Start) -> None:
    error = b'{"object":"error","message":"bad thing","code":400}'
    bad = await serve(
        fixed(b"HTTP/1.1 400 Bad Request\r\ncontent-length: %d\r\n\r\n%s" % (len(error), error))
    )
    client = upstream()
    try:
        with pytest.raises(UpstreamStatusError) as status:
            await client.open(Worker(f"http://127.0.0.1:{bad.port}"), "/x", b"{}", [])
        assert status.value.status == 400
        assert status.value.message == "bad thing"
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
            with pytest.raises(UpstreamConnectError):
                await client.open(Worker(f"http://127.0.0.1:{port}"), "/x", b"{}", [])
    finally:
        await client.aclose()
    # The error response was read to its end: its connection went back to the pool.
    assert bad.connections == 1


async def test_upstream_client_maps_a_hang_up_before_headers_to_connect_error(
    serve: Start,
) -> None:
    def make(server: Server) -> Handler:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await server.request(reader)

        return handle

    server = await serve(make)
    client = upstream()
    try:
        with pytest.raises(UpstreamConnectError) as info:
            await client.open(Worker(f"http://127.0.0.1:{server.port}"), "/x", b"{}", [])
        assert info.value.retryable
    finally:
        await client.aclose()


def test_timeout_is_a_gateway_timeout() -> None:
    from app.upstream.client import map_transport_error

    error = map_transport_error(wire.ReadTimeout("x"), Worker("http://w:1"), committed=False)
    assert isinstance(error, UpstreamTimeout)


async def test_upstream_client_control_calls_go_on_new_connections(serve: Start) -> None:
    """A control call's answer has no request id to check, so no late stray response may be
    waiting on its connection: each takes a new one."""
    loads = b'{"running":3}'
    server = await serve(
        fixed(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(loads), loads))
    )
    client = upstream(Settings(worker_api_key="sk-worker"))
    worker = Worker(f"http://127.0.0.1:{server.port}")
    try:
        assert await client.get(worker, "/v1/loads?include=core,spec", 5.0) == (200, {"running": 3})
        assert await client.abort(worker, "rid-1")
        assert await client.get(worker, "/health", 5.0) == (200, {"running": 3})
    finally:
        await client.aclose()
    assert server.connections == 3
    (get_head, get_body), (abort_head, abort_body), _ = server.requests
    assert get_head.startswith(b"GET /v1/loads?include=core,spec HTTP/1.1\r\n")
    assert b"authorization: Bearer sk-worker\r\n" in get_head
    assert b"content-length" not in get_head.lower()
    assert get_body == b""
    assert abort_head.startswith(b"POST /abort_request HTTP/1.1\r\n")
    assert abort_body == b'{"rid":"rid-1"}'


async def test_upstream_client_control_call_timeouts_and_failures(serve: Start) -> None:
    def silent(server: Server) -> Handler:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await server.request(reader)
            await reader.read()  # never answers; returns when the client hangs up

        return handle

    server = await serve(silent)
    client = upstream()
    try:
        with pytest.raises(UpstreamTimeout):
            await client.get(Worker(f"http://127.0.0.1:{server.port}"), "/health", 0.2)
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            dead = Worker(f"http://127.0.0.1:{sock.getsockname()[1]}")
            with pytest.raises(UpstreamConnectError):
                await client.get(dead, "/health", 5.0)
            assert not await client.abort(dead, "rid-2")
    finally:
        await client.aclose()
