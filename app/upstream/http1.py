"""A lean HTTP/1.1 client for workers: keep-alive pools of ``app.upstream.connection``
connections, and the response object the gateway reads.

It carries every call the gateway makes to a worker: the proxied POST (the hot path) and the
small control calls (``/health``, ``/v1/loads``, ``/v1/models``, ``/abort_request``).

Why not httpx here: per request, httpx/httpcore build a Request and a Response model, take the
pool's locks, scan every pooled connection (``is_idle`` on each), and run h11's pure-Python state
machine; per relayed chunk they pass through four nested async generators. This client does
what a proxy needs and no more:

* one keep-alive connection pool per worker (a LIFO stack of idle connections: the warmest one is
  reused; one past ``keepalive_s`` of idleness, or one the worker closed or wrote to while idle,
  is closed instead). Right before a request is written on a pooled connection, its socket is
  polled once for readable bytes (a ``poll`` system call, under a microsecond, no round trip):
  bytes the worker sent since the event loop last read it, or its hang-up, close it instead, so a
  late stray response still in the kernel's buffer never becomes the next request's answer. A
  request whose answer cannot be told apart from a stray one (``fresh``) is written on a new
  connection, on which no earlier response can be pending;
* the request's head and body leave in one ``write`` (TCP_NODELAY is set on every connection);
* the response is parsed by llhttp (httptools, C): Content-Length, chunked and until-close
  bodies, and nothing past a response's end (see ``app.upstream.connection``);
* body bytes are handed over as they arrive: everything parsed since the last read comes back as
  one ``bytes`` (a read that carried several SSE events relays them in one downstream write),
  either to the task iterating ``aiter_raw`` or, with ``pump``, to a callback run right in the
  read callback (no task switch per read: how a committed stream is relayed);
* backpressure: while more than ``HIGH_WATER`` bytes wait unread, the socket is not read, so a
  slow client slows the worker down through TCP instead of the gateway buffering the stream;
* a connection goes back to the pool only after its response was read to the end with
  keep-alive allowed and nothing after it; an error, an abort or a response closed early closes
  it;
* timeouts: connect always; first byte and idle only when given (the proxy's supervisor owns
  those deadlines for proxied requests, so no timer runs per chunk).

Errors are ``app.upstream.errors``; ``app.upstream.client`` maps them to ``app.errors``.
"""

from __future__ import annotations

import asyncio
import contextlib
import select
import socket
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import NoReturn

from app.upstream.connection import Connection
from app.upstream.errors import ConnectFailed, ConnectTimeout, MalformedResponse, ReadTimeout

_NODELAY = (socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
_MAX_HOSTS = 1024  # pools kept before empty ones are dropped
_READABLE = select.POLLIN | select.POLLPRI | select.POLLERR | select.POLLHUP


class Http1Response:
    """The status and headers of a worker's response; its body by ``aiter_raw`` or ``aread``.
    ``aclose`` returns the connection to the pool if the body was read to the end, else closes
    it (safe to call more than once)."""

    __slots__ = ("_client", "_conn", "_headers", "_idle_s", "_raw", "_stopped", "status_code")

    def __init__(self, client: Http1Client, conn: Connection, idle_s: float | None) -> None:
        self._client = client
        self._conn: Connection | None = conn
        self._idle_s = idle_s
        self._headers: dict[str, str] | None = None
        # The connection's list for this response (the next response gets a new one): decoded
        # only if asked for, which the relay never does.
        self._raw = conn.headers
        self.status_code = conn.status
        self._stopped = False  # the reader has all it wants (``stop``)

    @property
    def headers(self) -> dict[str, str]:
        """Lower-cased names (the last of repeated headers wins)."""
        if self._headers is None:
            raw = self._raw
            self._headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in raw}
        return self._headers

    @property
    def buffered(self) -> int:
        """Body bytes received and not yet read."""
        return self._conn.pending if self._conn is not None else 0

    def aiter_raw(self) -> Http1Response:
        return self

    def __aiter__(self) -> Http1Response:
        return self

    async def __anext__(self) -> bytes:
        conn = self._conn
        while conn is not None:
            if conn.body:
                return conn.take()
            if conn.complete:
                break
            if conn.error is not None:
                self._fail(conn.error)
            await self._wait(conn)
        self._finish()
        raise StopAsyncIteration

    async def pump(
        self, sink: Callable[[bytes], bool], drain: Callable[[], Awaitable[None]]
    ) -> None:
        """Hand the rest of the body to ``sink`` as it arrives, from the connection's read
        callback (no task switch per read), until the body ends; then release the connection as
        ``aclose`` does. ``sink`` returns True when its consumer is behind: reading pauses until
        ``drain()`` returns. Errors are raised as ``__anext__`` raises them; an exception from
        ``sink`` is raised here. When ``sink`` calls ``stop()`` it returns at once, the
        connection still held (``release_at_end`` or ``discard`` it)."""
        conn = self._conn
        if conn is None:
            return
        conn.sink = sink
        try:
            while True:
                if conn.paused and not self._stopped:  # the consumer is behind
                    await drain()
                    conn.resume()
                if conn.body and not self._stopped and sink(conn.take()):
                    conn.pause()
                    continue
                if self._stopped:
                    return
                if conn.error is not None:  # before complete: the sink may fail on the last read
                    self._fail(conn.error)
                if conn.complete:
                    break
                if not conn.paused:
                    await self._wait(conn)
        except BaseException:
            self._drop()  # cut short (consumer failed, cancelled): never reuse the connection
            raise
        finally:
            conn.sink = None
        self._finish()

    def stop(self) -> None:
        """The reader has all it wants of the body (a stream's last event arrived): no more is
        handed to ``pump``'s sink, and ``pump`` returns without waiting for the response's end.
        Safe to call from the sink."""
        self._stopped = True
        conn = self._conn
        if conn is not None:
            conn.sink = None
            conn.wake()

    def release_at_end(self, stray: Callable[[], None] | None = None) -> None:
        """Let go of a response whose reader has all it wants before its end arrived: the
        connection goes back to the pool once the response's end arrives with no body byte
        more. A body byte first (``stray()`` is called: the worker sent data it had said was
        the last), an error, or ``keepalive_s`` without the end closes it. Nothing waits for
        it."""
        conn, self._conn = self._conn, None
        if conn is None:
            return
        if conn.body:
            if stray is not None:
                stray()
            conn.close()
        elif conn.complete or conn.error is not None or conn.closed:
            if conn.reusable():
                self._client.release(conn)
            else:
                conn.close()
        else:
            self._client.park(conn, stray)

    async def _wait(self, conn: Connection) -> None:
        waiter = conn.waiter = conn.loop.create_future()
        if self._idle_s is None:
            await waiter
            return
        try:
            async with asyncio.timeout(self._idle_s):
                await waiter
        except TimeoutError:
            self._drop()
            raise ReadTimeout(f"no data from the worker for {self._idle_s}s") from None

    async def aread(self, limit: int | None = None) -> bytes:
        """The whole body. Raises ``MalformedResponse`` when the worker sent bytes after its
        end (the body may be a truncated one) or, with ``limit``, a body over ``limit`` bytes."""
        conn = self._conn
        parts: list[bytes] = []
        size = 0
        async for part in self.aiter_raw():
            parts.append(part)
            size += len(part)
            if limit is not None and size > limit:
                self._drop()
                raise MalformedResponse(f"response body over {limit} bytes")
        if conn is not None and conn.spoiled:
            raise MalformedResponse("bytes after the end of the response")
        return parts[0] if len(parts) == 1 else b"".join(parts)

    async def aclose(self) -> None:
        self._finish()

    def discard(self) -> None:
        """Close the connection, whatever was read of the response: its worker is out of step
        (it answered another request), so nothing more from it is to be trusted."""
        self._drop()

    def _finish(self) -> None:
        conn, self._conn = self._conn, None
        if conn is None:
            return
        if conn.reusable() and not conn.body:
            self._client.release(conn)
        else:
            conn.close()

    def _fail(self, error: BaseException) -> NoReturn:
        self._drop()
        raise error

    def _drop(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()


class Http1Client:
    """Keep-alive HTTP/1.1 connections to workers, one LIFO pool per host:port."""

    def __init__(
        self,
        *,
        connect_s: float,
        keepalive_s: float = 4.0,
        max_idle_per_host: int = 1024,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        # keepalive_s stays under SGLang's own idle timeout (uvicorn's timeout_keep_alive, 5 s by
        # default), so a request is not sent on a connection the worker is about to close.
        self._connect_s = connect_s
        self._keepalive_s = keepalive_s
        self._max_idle = max_idle_per_host
        self._clock = clock
        self._idle: dict[tuple[str, int], list[Connection]] = {}
        self._closed = False

    async def request(
        self,
        host: str,
        port: int,
        data: bytes | Sequence[bytes | memoryview],
        *,
        first_byte_s: float | None = None,
        idle_s: float | None = None,
        sent: Callable[[], None] | None = None,
        fresh: bool = False,
    ) -> Http1Response:
        """Send ``data`` (a whole request: head and body, whole or in pieces written in order)
        and return the response once its status and headers arrived (``sent()`` is called once
        the request is handed to its connection). ``fresh``: on a new connection, never a pooled
        one (for a request whose answer carries nothing that tells it from a stray one). Raises
        a ``TransportError`` (``app.upstream.errors``)."""
        conn = await (self._connect(host, port) if fresh else self._acquire(host, port))
        try:
            conn.begin(data)
            if sent is not None:
                sent()
            while not conn.headers_done:
                if conn.error is not None:
                    raise conn.error
                waiter = conn.waiter = conn.loop.create_future()
                if first_byte_s is None:
                    await waiter
                else:
                    try:
                        async with asyncio.timeout(first_byte_s):
                            await waiter
                    except TimeoutError:
                        raise ReadTimeout(
                            f"no response from the worker in {first_byte_s}s"
                        ) from None
        except BaseException:
            conn.close()
            raise
        return Http1Response(self, conn, idle_s)

    async def _acquire(self, host: str, port: int) -> Connection:
        key = (host, port)
        idle = self._idle.get(key)
        if idle:
            now = self._clock()
            while idle:
                conn = idle.pop()
                conn.pool = None
                if (
                    not conn.closed
                    and conn.transport is not None
                    and not conn.transport.is_closing()
                    and now - conn.idle_since < self._keepalive_s
                    and not _readable(conn.fd)
                ):
                    return conn
                conn.close()
        return await self._connect(host, port)

    async def _connect(self, host: str, port: int) -> Connection:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self._connect_s):
                transport, conn = await loop.create_connection(Connection, host, port)
        except TimeoutError:
            raise ConnectTimeout(f"connect to {host}:{port} timed out") from None
        except OSError as exc:
            raise ConnectFailed(f"cannot connect to {host}:{port}: {exc}") from exc
        conn.key = (host, port)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            conn.fd = sock.fileno()
            with contextlib.suppress(OSError):
                sock.setsockopt(*_NODELAY)
        return conn

    def release(self, conn: Connection) -> None:
        """A connection whose response was read to the end, back to its pool."""
        conn.in_use = False
        if self._closed or conn.transport is None:
            conn.close()
            return
        idle = self._idle.get(conn.key)
        if idle is None:
            if len(self._idle) >= _MAX_HOSTS:  # workers come and go under discovery
                for key in [k for k, v in self._idle.items() if not v]:
                    del self._idle[key]
            idle = self._idle[conn.key] = []
        now = self._clock()
        # The oldest idle connections sit at the bottom; expire them as we go.
        while idle and (
            len(idle) >= self._max_idle or now - idle[0].idle_since >= self._keepalive_s
        ):
            old = idle.pop(0)
            old.pool = None
            old.close()
        conn.idle_since = now
        conn.pool = idle
        idle.append(conn)

    def park(self, conn: Connection, stray: Callable[[], None] | None) -> None:
        """Hold ``conn`` out of the pool until the end of its response arrives (then it goes
        in), a body byte arrives first (``stray()``, closed), it fails, or ``keepalive_s``
        passes (closed). No task: a callback on each read."""
        if conn.paused:
            conn.resume()
        timer = conn.loop.call_later(self._keepalive_s, conn.close)

        def arm() -> None:
            conn.waiter = conn.loop.create_future()
            conn.waiter.add_done_callback(check)

        def check(_: object) -> None:
            if conn.body:
                if stray is not None:
                    stray()
                conn.close()
            elif conn.complete and conn.reusable():
                self.release(conn)
            elif conn.complete or conn.error is not None or conn.closed:
                conn.close()
            else:  # a partial read of the response's end
                arm()
                return
            timer.cancel()

        arm()

    def idle_connections(self, host: str, port: int) -> int:
        """Open connections to ``host:port`` waiting in the pool."""
        return sum(not c.closed for c in self._idle.get((host, port), ()))

    async def aclose(self) -> None:
        self._closed = True
        for idle in self._idle.values():
            for conn in idle:
                conn.pool = None
                conn.close()
        self._idle.clear()


def _readable(fd: int) -> bool:
    """Whether the socket ``fd`` has bytes (or a hang-up, or an error) waiting to be read: a
    pooled connection must have none. (``poll``, not ``select``: descriptors past 1024.)"""
    if fd < 0:
        return False
    poller = select.poll()
    poller.register(fd, _READABLE)
    return bool(poller.poll(0))
