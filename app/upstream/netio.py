"""An asyncio-native network backend for httpcore (replaces its anyio backend on the hot path).

httpcore's anyio backend costs a cancel scope, a checkpoint and an exception-mapping context per
read, and builds a dict of socket attributes each time the pool asks whether an idle connection
is still usable (once per idle connection per request). This backend keeps a plain
``asyncio.Protocol`` per connection: ``read`` returns buffered bytes or awaits one future,
``write`` queues bytes that leave at the end of the event-loop step (a request's head and body
go out in one ``send``), and ``is_readable`` is an attribute lookup. Reading pauses while more than
``_HIGH_WATER`` bytes wait unread, so a client that reads slowly slows the worker down (TCP
backpressure) instead of the gateway buffering the whole response. Timeouts passed by
httpcore are honoured with ``asyncio.timeout`` only when set; the proxy sets none on the stream
(its supervisor owns deadlines).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Iterable
from typing import Any, cast

import httpcore

_READ_TIMEOUT = httpcore.ReadTimeout
_HIGH_WATER = 256 * 1024  # unread bytes buffered before the socket stops being read
_LOW_WATER = 64 * 1024  # ... and resumes
_NODELAY = (socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class _Protocol(asyncio.Protocol):
    __slots__ = (
        "buffer",
        "closed",
        "eof",
        "error",
        "paused",
        "transport",
        "waiter",
        "writable",
    )

    def __init__(self) -> None:
        self.buffer = bytearray()
        self.paused = False  # reading paused: the buffer is over the high-water mark
        self.eof = False
        self.closed = False
        self.error: BaseException | None = None
        self.waiter: asyncio.Future[None] | None = None
        self.transport: asyncio.Transport | None = None
        self.writable: asyncio.Future[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        if len(self.buffer) > _HIGH_WATER and not self.paused:
            self._set_reading(False)
        self._wake()

    def consumed(self) -> None:
        """Bytes were taken from the buffer: resume reading once it is low enough."""
        if self.paused and len(self.buffer) < _LOW_WATER:
            self._set_reading(True)

    def _set_reading(self, on: bool) -> None:
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        self.paused = not on
        with contextlib.suppress(RuntimeError):  # the transport closed meanwhile
            if on:
                transport.resume_reading()
            else:
                transport.pause_reading()

    def eof_received(self) -> bool:
        self.eof = True
        self._wake()
        return False  # close our side too

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.eof = True
        self.error = exc
        self._wake()
        if self.writable is not None and not self.writable.done():
            self.writable.set_result(None)

    def pause_writing(self) -> None:
        self.writable = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        if self.writable is not None and not self.writable.done():
            self.writable.set_result(None)
        self.writable = None

    def _wake(self) -> None:
        waiter = self.waiter
        if waiter is not None:
            self.waiter = None
            if not waiter.done():
                waiter.set_result(None)


class AsyncioStream(httpcore.AsyncNetworkStream):
    def __init__(self, transport: asyncio.Transport, protocol: _Protocol) -> None:
        self._transport = transport
        self._protocol = protocol
        self._pending: list[bytes] = []

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:  # noqa: ASYNC109
        p = self._protocol
        if not p.buffer and not p.eof:
            p.waiter = asyncio.get_running_loop().create_future()
            if timeout is None:
                await p.waiter
            else:
                try:
                    async with asyncio.timeout(timeout):
                        await p.waiter
                except TimeoutError:
                    raise _READ_TIMEOUT(f"no data for {timeout}s") from None
        if p.buffer:
            data = bytes(p.buffer[:max_bytes])
            del p.buffer[:max_bytes]
            if p.paused:
                p.consumed()
            return data
        if p.error is not None:
            raise httpcore.ReadError(str(p.error)) from p.error
        return b""  # EOF

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:  # noqa: ASYNC109
        if not buffer:
            return
        p = self._protocol
        if p.closed or self._transport.is_closing():
            raise httpcore.WriteError("connection closed")
        if not self._pending:
            # httpcore writes a request's head and body back to back; one send() for both.
            asyncio.get_running_loop().call_soon(self._flush)
        self._pending.append(buffer)
        if p.writable is not None:
            try:
                async with asyncio.timeout(timeout):
                    await p.writable
            except TimeoutError:
                raise httpcore.WriteTimeout(f"could not write for {timeout}s") from None

    def _flush(self) -> None:
        pending, self._pending = self._pending, []
        if pending and not self._transport.is_closing():
            self._transport.write(pending[0] if len(pending) == 1 else b"".join(pending))

    async def aclose(self) -> None:
        self._flush()
        self._transport.close()

    async def start_tls(self, *args: Any, **kwargs: Any) -> httpcore.AsyncNetworkStream:
        raise httpcore.UnsupportedProtocol("TLS to workers is not supported by this backend")

    def get_extra_info(self, info: str) -> Any:
        if info == "is_readable":
            # httpcore asks this of idle pooled connections: readable = the peer closed it or
            # sent something unexpected, so the connection must not be reused.
            return self._protocol.eof or bool(self._protocol.buffer)
        if info == "socket":
            return self._transport.get_extra_info("socket")
        if info == "client_addr":
            return self._transport.get_extra_info("sockname")
        if info == "server_addr":
            return self._transport.get_extra_info("peername")
        return None


class AsyncioBackend(httpcore.AsyncNetworkBackend):
    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,  # noqa: ASYNC109
        local_address: str | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        loop = asyncio.get_running_loop()
        local = (local_address, 0) if local_address else None
        try:
            async with asyncio.timeout(timeout):
                transport, protocol = await loop.create_connection(
                    _Protocol, host, port, local_addr=local
                )
        except TimeoutError:
            raise httpcore.ConnectTimeout(f"connect to {host}:{port} timed out") from None
        except OSError as exc:
            raise httpcore.ConnectError(str(exc)) from exc
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(*_NODELAY)
                for option in socket_options or ():
                    sock.setsockopt(*option)
        return AsyncioStream(transport, protocol)

    async def connect_unix_socket(
        self,
        path: str,
        timeout: float | None = None,  # noqa: ASYNC109
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        raise httpcore.UnsupportedProtocol("unix sockets are not supported by this backend")

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)
