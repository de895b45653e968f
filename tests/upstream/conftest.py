from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Mapping

import pytest
import uvloop

from app.upstream.http1 import Http1Client
from tests.upstream.fakes import Handler, Server, Start


def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> Mapping[str, Callable[[], asyncio.AbstractEventLoop]]:
    """The upstream clients' tests run on asyncio's loop and on uvloop (the gateway's loop,
    whose transports are a separate implementation)."""
    return {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}


@pytest.fixture
async def serve() -> AsyncIterator[Start]:
    servers: list[asyncio.Server] = []

    async def start(make: Callable[[Server], Handler]) -> Server:
        server = Server(lambda r, w: make(server)(r, w))
        srv = await asyncio.start_server(server.serve, "127.0.0.1", 0)
        server.port = srv.sockets[0].getsockname()[1]
        servers.append(srv)
        return server

    yield start
    for srv in servers:
        srv.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(srv.wait_closed(), 5)


@pytest.fixture
async def client() -> AsyncIterator[Http1Client]:
    c = Http1Client(connect_s=2.0)
    yield c
    await c.aclose()
