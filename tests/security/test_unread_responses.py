"""Clients that never read their responses cannot pin the gateway's connection slots: every
response has a write deadline (``timeouts.client_write_s``; ``app.server.guard``)."""

from __future__ import annotations

import asyncio
import socket

from tests.support.gateway import FakeWorker, GatewayHarness, wait_for

SLOTS = 8
METRICS = b"GET /metrics HTTP/1.1\r\nHost: a\r\n\r\n"


async def _silent_client(port: int, payload: bytes) -> socket.socket:
    """A connection that sends ``payload`` and never reads (a small receive buffer, so the
    answers back up into the gateway quickly)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
    await asyncio.get_running_loop().sock_sendall(sock, payload)
    return sock


async def _livez_status(port: int) -> int:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(b"GET /livez HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n")
        head = await asyncio.wait_for(reader.readuntil(b"\r\n"), 5)
        return int(head.split()[1])
    finally:
        writer.close()


def _timeouts(gw: GatewayHarness) -> float:
    value = gw.gateway.metrics.registry.get_sample_value(
        "dflash_gateway_client_write_timeouts_total"
    )
    assert value is not None
    return float(value)


async def test_clients_that_never_read_are_cut_off_and_new_clients_get_served() -> None:
    async with GatewayHarness(
        [FakeWorker()],
        limits={"max_connections": SLOTS},
        timeouts={"client_write_s": 1.0},
    ) as gw:
        port = int(gw.url.rsplit(":", 1)[1])
        silent = [await _silent_client(port, METRICS * 100) for _ in range(SLOTS)]
        try:
            assert await _livez_status(port) == 503  # every slot is taken now
            await wait_for(lambda: _timeouts(gw) == SLOTS, timeout=15)
            assert await _livez_status(port) == 200
            for sock in silent:  # the gateway hung up on each
                data = b""
                with_reset = False
                try:
                    while chunk := sock.recv(1 << 20):
                        data += chunk
                except ConnectionResetError:
                    with_reset = True
                except BlockingIOError:
                    raise AssertionError("the connection is still open") from None
                assert with_reset or data  # cut: reset, or what was sent then the end
        finally:
            for sock in silent:
                sock.close()
