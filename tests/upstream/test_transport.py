"""WorkerTransport (httpcore on the asyncio backend) against tiny loopback HTTP servers."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import httpx
import pytest

from app.upstream.transport import WorkerTransport
from tests.support.procs import free_port

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def _read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    return head + await reader.readexactly(length)


class Server:
    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0
        self.port = 0

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            await self.handler(reader, writer)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@pytest.fixture
async def serve() -> AsyncIterator[Callable[[Handler], Awaitable[Server]]]:
    servers: list[asyncio.Server] = []

    async def start(handler: Handler) -> Server:
        server = Server(handler)
        srv = await asyncio.start_server(server._serve, "127.0.0.1", 0)
        server.port = srv.sockets[0].getsockname()[1]
        servers.append(srv)
        return server

    yield start
    for srv in servers:
        srv.close()
        await srv.wait_closed()


async def keepalive_sse(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while True:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n")
        writer.write(b"transfer-encoding: chunked\r\n\r\n")
        for event in (b"data: 1\n\n", b"data: [DONE]\n\n"):
            writer.write(b"%x\r\n%s\r\n" % (len(event), event))
            await writer.drain()
        writer.write(b"0\r\n\r\n")
        await writer.drain()


async def test_streams_chunks_and_reuses_the_connection(
    serve: Callable[..., Awaitable[Server]],
) -> None:
    server = await serve(keepalive_sse)
    async with httpx.AsyncClient(transport=WorkerTransport()) as client:
        for _ in range(3):
            async with client.stream("POST", server.url + "/x", content=b"{}") as response:
                parts = [p async for p in response.aiter_raw()]
            assert b"".join(parts) == b"data: 1\n\ndata: [DONE]\n\n"
    assert server.connections == 1


async def test_a_connection_the_server_closed_is_not_reused(
    serve: Callable[..., Awaitable[Server]],
) -> None:
    async def one_shot(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
        await writer.drain()

    server = await serve(one_shot)
    async with httpx.AsyncClient(transport=WorkerTransport()) as client:
        for _ in range(3):
            response = await client.post(server.url + "/x", content=b"{}")
            assert response.content == b"ok"
            await asyncio.sleep(0.01)  # the server's FIN arrives while the connection idles
    assert server.connections == 3


async def test_connection_refused_is_httpx_connect_error() -> None:
    async with httpx.AsyncClient(transport=WorkerTransport()) as client:
        with pytest.raises(httpx.ConnectError):
            await client.get(f"http://127.0.0.1:{free_port()}/health")


async def test_drop_mid_body_is_remote_protocol_error(
    serve: Callable[..., Awaitable[Server]],
) -> None:
    async def drop(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n9\r\ndata: 1\n\n\r\n")
        await writer.drain()

    server = await serve(drop)
    async with (
        httpx.AsyncClient(transport=WorkerTransport()) as client,
        client.stream("POST", server.url + "/x", content=b"{}") as response,
    ):
        with pytest.raises(httpx.RemoteProtocolError):
            async for _ in response.aiter_raw():
                pass


async def test_read_timeout_when_set(serve: Callable[..., Awaitable[Server]]) -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        await asyncio.Event().wait()

    server = await serve(silent)
    async with httpx.AsyncClient(transport=WorkerTransport()) as client:
        with pytest.raises(httpx.ReadTimeout):
            await client.get(server.url + "/x", timeout=httpx.Timeout(1.0, read=0.05))
