"""A lean HTTP/1.1 client for the proxied POST: asyncio Protocols + httptools' response parser.

Why not httpx here: per request, httpx/httpcore build a Request and a Response model, take the
pool's locks, scan every pooled connection (``is_idle`` on each), and run h11's pure-Python state
machine; per relayed chunk they pass through four nested async generators. This client does
what a proxy needs and no more:

* one keep-alive connection pool per worker (a LIFO stack of idle connections: the warmest one is
  reused; one past ``keepalive_s`` of idleness, or one the worker closed or wrote to while idle,
  is closed instead);
* the request's head and body leave in one ``write`` (TCP_NODELAY is set on every connection);
* the response is parsed by llhttp (httptools, C): Content-Length, chunked and until-close bodies;
* body bytes are handed over as they arrive: everything parsed since the last read comes back as
  one ``bytes`` (a read that carried several SSE events relays them in one downstream write),
  either to the task iterating ``aiter_raw`` or, with ``pump``, to a callback run right in the
  read callback (no task switch per read: how a committed stream is relayed);
* backpressure: while more than ``high_water`` bytes wait unread, the socket is not read, so a
  slow client slows the worker down through TCP instead of the gateway buffering the stream;
* a connection goes back to the pool only after its response was read to the end with
  keep-alive allowed; an error, an abort or a response closed early closes it;
* timeouts: connect always; first byte and idle only when given (the proxy's supervisor owns
  those deadlines for proxied requests, so no timer runs per chunk).

Errors are raised in httpx's vocabulary (``httpx.ConnectError``, ``httpx.ReadError``,
``httpx.RemoteProtocolError``, ``httpx.ReadTimeout``...), so ``app.upstream.client`` maps them
to ``app.errors`` exactly as it does for an injected httpx transport.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import Awaitable, Callable
from typing import NoReturn, cast

import httptools
import httpx

_NODELAY = (socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
HIGH_WATER = 64 * 1024  # unread body bytes before the socket stops being read
_MAX_HOSTS = 1024  # pools kept before empty ones are dropped


class _Connection(asyncio.Protocol):
    """One TCP connection to a worker and the response currently arriving on it."""

    __slots__ = (
        "body",
        "closed",
        "complete",
        "error",
        "headers",
        "headers_done",
        "idle_since",
        "in_use",
        "keep_alive",
        "key",
        "loop",
        "parser",
        "paused",
        "pending",
        "pool",
        "sink",
        "status",
        "transport",
        "until_close",
        "waiter",
    )

    def __init__(self) -> None:
        # Kept: asyncio.get_running_loop() costs a getpid() system call on Python < 3.12.
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.error: BaseException | None = None
        self.waiter: asyncio.Future[None] | None = None
        self.in_use = False  # a request is outstanding
        self.key = ("", 0)  # the pool it belongs to: host, port
        self.idle_since = 0.0
        self.pool: list[_Connection] | None = None  # the idle stack holding it, if any
        self.paused = False
        # Set while ``Http1Response.pump`` runs: body bytes go to it from ``data_received``.
        self.sink: Callable[[bytes], bool] | None = None
        self._reset()

    def _reset(self) -> None:
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.headers_done = False
        self.complete = False
        self.keep_alive = False
        self.until_close = False
        self.body: list[bytes] = []
        self.pending = 0  # bytes in ``body``

    # asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        if not self.in_use:  # bytes on an idle connection: it is out of step, never reuse it
            self.close()
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self.error = httpx.RemoteProtocolError(f"malformed response from worker: {exc}")
            self.close()
        sink = self.sink
        if sink is not None:
            body = self.body
            if body and not self.paused:
                # take(), inlined: this is the relay's per-chunk path.
                self.body = []
                self.pending = 0
                try:
                    behind = sink(body[0] if len(body) == 1 else b"".join(body))
                except Exception as exc:  # the consumer's failure ends this response (see pump)
                    self.error = exc
                    self.close()
                    behind = False
                if behind:
                    self.pause()
            if not (self.complete or self.paused or self.error is not None):
                return  # the pumping task has nothing to do: don't wake it
        elif self.pending > HIGH_WATER and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()
        self._wake()

    def pause(self) -> None:
        if not self.paused and self.transport is not None and not self.closed:
            self.paused = True
            self.transport.pause_reading()

    def eof_received(self) -> bool:
        if self.until_close and self.headers_done:
            self.complete = True  # a body delimited by the end of the connection
        return False  # close the transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if not self.complete and self.error is None:
            if exc is None:
                self.error = httpx.RemoteProtocolError("the worker closed the connection")
            else:
                self.error = httpx.ReadError(f"connection to the worker lost: {exc}")
        if self.pool is not None:
            with contextlib.suppress(ValueError):
                self.pool.remove(self)
            self.pool = None
        self._wake()

    # httptools callbacks

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        if status < 200:  # an interim response (100 Continue): the real one follows
            self.headers = []
            return
        self.status = status
        self.headers_done = True
        framed = False
        for name, value in self.headers:
            lower = name.lower()
            if lower == b"content-length" or (
                lower == b"transfer-encoding" and b"chunked" in value.lower()
            ):
                framed = True
        self.until_close = not framed and status not in (204, 304)

    def on_body(self, body: bytes) -> None:
        self.body.append(body)
        self.pending += len(body)

    def on_message_complete(self) -> None:
        if self.headers_done:
            self.complete = True
            self.keep_alive = self.parser.should_keep_alive()

    # used by the client

    def _wake(self) -> None:
        waiter = self.waiter
        if waiter is not None:
            self.waiter = None
            if not waiter.done():
                waiter.set_result(None)

    def take(self) -> bytes:
        """Everything parsed since the last call (the caller checked ``body`` is not empty)."""
        body = self.body
        data = body[0] if len(body) == 1 else b"".join(body)
        self.body = []
        self.pending = 0
        if self.paused:
            self.paused = False
            if self.transport is not None and not self.closed:
                self.transport.resume_reading()
        return data

    def begin(self, request: bytes) -> None:
        self.in_use = True
        self._reset()
        assert self.transport is not None
        self.transport.write(request)

    def reusable(self) -> bool:
        return (
            self.complete
            and self.keep_alive
            and not self.closed
            and not self.until_close
            and self.error is None
            and not self.paused
        )

    def close(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.close()
        self.closed = True


class Http1Response:
    """The status and headers of a worker's response; its body by ``aiter_raw`` or ``aread``.
    ``aclose`` returns the connection to the pool if the body was read to the end, else closes
    it (safe to call more than once)."""

    __slots__ = ("_client", "_conn", "_headers", "_idle_s", "status_code")

    def __init__(self, client: Http1Client, conn: _Connection, idle_s: float | None) -> None:
        self._client = client
        self._conn: _Connection | None = conn
        self._idle_s = idle_s
        self._headers: dict[str, str] | None = None
        self.status_code = conn.status

    @property
    def headers(self) -> dict[str, str]:
        """Lower-cased names (the last of repeated headers wins)."""
        if self._headers is None:
            conn = self._conn
            raw = conn.headers if conn is not None else []
            self._headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in raw}
        return self._headers

    @property
    def buffered(self) -> int:
        """Body bytes received and not yet read."""
        return self._conn.pending if self._conn is not None else 0

    def aiter_raw(self) -> Http1Response:
        if self._headers is None:  # keep the headers readable after the connection is released
            _ = self.headers
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
        ``sink`` is raised here."""
        conn = self._conn
        if conn is None:
            return
        if self._headers is None:
            _ = self.headers
        conn.sink = sink
        try:
            while True:
                if conn.paused:  # the consumer is behind (or the body outgrew the buffer)
                    await drain()
                    conn.paused = False
                    if conn.transport is not None and not conn.closed:
                        conn.transport.resume_reading()
                if conn.body and sink(conn.take()):
                    conn.pause()
                    continue
                if conn.complete:
                    break
                if conn.error is not None:
                    self._fail(conn.error)
                if not conn.paused:
                    await self._wait(conn)
        except BaseException:
            self._drop()  # cut short (consumer failed, cancelled): never reuse the connection
            raise
        finally:
            conn.sink = None
        self._finish()

    async def _wait(self, conn: _Connection) -> None:
        waiter = conn.waiter = conn.loop.create_future()
        if self._idle_s is None:
            await waiter
            return
        try:
            async with asyncio.timeout(self._idle_s):
                await waiter
        except TimeoutError:
            self._drop()
            raise httpx.ReadTimeout(f"no data from the worker for {self._idle_s}s") from None

    async def aread(self) -> bytes:
        parts = [part async for part in self.aiter_raw()]
        return parts[0] if len(parts) == 1 else b"".join(parts)

    async def aclose(self) -> None:
        self._finish()

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
        self._idle: dict[tuple[str, int], list[_Connection]] = {}
        self._closed = False

    async def request(
        self,
        host: str,
        port: int,
        data: bytes,
        *,
        first_byte_s: float | None = None,
        idle_s: float | None = None,
    ) -> Http1Response:
        """Send ``data`` (a whole request: head and body) and return the response once its
        status and headers arrived."""
        conn = await self._acquire(host, port)
        try:
            conn.begin(data)
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
                        raise httpx.ReadTimeout(
                            f"no response from the worker in {first_byte_s}s"
                        ) from None
        except BaseException:
            conn.close()
            raise
        return Http1Response(self, conn, idle_s)

    async def _acquire(self, host: str, port: int) -> _Connection:
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
                ):
                    return conn
                conn.close()
        return await self._connect(host, port)

    async def _connect(self, host: str, port: int) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self._connect_s):
                transport, conn = await loop.create_connection(_Connection, host, port)
        except TimeoutError:
            raise httpx.ConnectTimeout(f"connect to {host}:{port} timed out") from None
        except OSError as exc:
            raise httpx.ConnectError(f"cannot connect to {host}:{port}: {exc}") from exc
        conn.key = (host, port)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(*_NODELAY)
        return conn

    def release(self, conn: _Connection) -> None:
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
