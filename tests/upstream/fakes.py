"""Small HTTP/1.1 servers on loopback that speak raw bytes, for the upstream client's tests:
each handler decides exactly what a worker writes, well-formed or not."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
SSE = (b"data: 1\n\n", b"data: 2\n\n", b"data: [DONE]\n\n")


async def read_request(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    """(head, body) of one request with a Content-Length body."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    return head, await reader.readexactly(length)


def chunked(*parts: bytes) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts) + b"0\r\n\r\n"


SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
)


class Server:
    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0
        self.requests: list[tuple[bytes, bytes]] = []
        self.port = 0

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            await self.handler(reader, writer)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def request(self, reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
        request = await read_request(reader)
        self.requests.append(request)
        return request


Start = Callable[[Callable[[Server], Handler]], Awaitable[Server]]


def post(port: int, body: bytes = b"{}", path: str = "/x") -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\ncontent-length: {len(body)}\r\n\r\n"
    ).encode() + body


def keepalive_sse(server: Server) -> Handler:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            await server.request(reader)
            writer.write(SSE_HEAD)
            for event in SSE:  # one write per event, as a worker streams them
                writer.write(b"%x\r\n%s\r\n" % (len(event), event))
                await writer.drain()
            writer.write(b"0\r\n\r\n")
            await writer.drain()

    return handle


def fixed(response: bytes, *, keep: bool = True) -> Callable[[Server], Handler]:
    def make(server: Server) -> Handler:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            while True:
                await server.request(reader)
                writer.write(response)
                await writer.drain()
                if not keep:
                    return

        return handle

    return make


async def body_of(response: object) -> bytes:
    assert hasattr(response, "aiter_raw")
    return b"".join([part async for part in response.aiter_raw()])
