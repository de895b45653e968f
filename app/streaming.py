"""The client side of one proxied request, in raw ASGI.

``Downstream`` sends the response: SSE headers on the first byte, body chunks as they come, a JSON
error (any status) while nothing was sent, or an SSE error event + ``[DONE]`` once it was.

``Supervisor`` is one helper task per request that does everything time- or disconnect-driven, so
the relay loop itself carries no per-chunk timers: it notices the client going away (ASGI
``http.disconnect``), sends ``: keep-alive`` after ``keepalive_s`` of silence on a stream, and
enforces the first-byte / idle / total deadlines. When the client goes away or a deadline passes
it records why in ``reason`` and cancels the request task; the proxy turns that into cleanup
(close upstream) or a 504. Both first run ``abort_attempt`` (the proxy's abort of the running
attempt on its worker), so the worker is told before the upstream connection drops.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import orjson

from app.config import TimeoutConfig
from app.directbody import DirectBody
from app.errors import SSE_DONE, GatewayError

Message = MutableMapping[str, Any]
Send = Callable[[Message], Awaitable[None]]
Receive = Callable[[], Awaitable[Message]]
Clock = Callable[[], float]

KEEPALIVE = b": keep-alive\n\n"
DISCONNECT = "client_disconnect"
TIMEOUT = "timeout"


class Downstream:
    __slots__ = ("_direct", "_request_id", "_send", "clock", "last_tx", "started", "stream")

    def __init__(
        self,
        send: Send,
        request_id: str,
        *,
        stream: bool,
        clock: Clock,
        direct: DirectBody | None = None,
    ) -> None:
        self._send = send
        self._direct = direct  # the server's lane around send for body chunks, if it has one
        self._request_id = request_id.encode("latin-1")
        self.stream = stream
        self.clock = clock
        self.started = False  # response headers sent: errors from now on go in-band
        self.last_tx = clock()

    def direct(self) -> DirectBody | None:
        """Where stream chunks may be written without ``send`` from now on (``app.directbody``);
        None if the server offers no such lane or the response is not a started stream."""
        direct = self._direct
        return direct if direct is not None and self.started and direct.ready() else None

    async def _start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        self.started = True
        headers.append((b"x-request-id", self._request_id))
        await self._send({"type": "http.response.start", "status": status, "headers": headers})

    async def start_stream(self) -> None:
        await self._start(
            200,
            [
                (b"content-type", b"text/event-stream"),
                (b"cache-control", b"no-cache"),
                (b"x-accel-buffering", b"no"),
            ],
        )

    async def chunk(self, data: bytes) -> None:
        """One piece of the SSE stream (starts the response on the first call)."""
        if not self.started:
            await self.start_stream()
        await self._send({"type": "http.response.body", "body": data, "more_body": True})

    async def keepalive(self) -> None:
        await self.chunk(KEEPALIVE)
        self.last_tx = self.clock()

    async def end(self) -> None:
        await self._send({"type": "http.response.body", "body": b"", "more_body": False})

    async def complete(
        self,
        status: int,
        body: bytes,
        content_type: bytes,
        headers: list[tuple[bytes, bytes]] | None = None,
    ) -> None:
        """A whole non-streamed response (``headers``: more response headers)."""
        await self._start(
            status,
            [
                (b"content-type", content_type),
                (b"content-length", str(len(body)).encode()),
                *(headers or ()),
            ],
        )
        await self._send({"type": "http.response.body", "body": body, "more_body": False})

    async def fail(self, error: GatewayError) -> None:
        """The error as the whole response if nothing was sent yet, else in-band + [DONE]."""
        if self.started:
            await self.chunk(error.to_sse() + SSE_DONE)
            await self.end()
            return
        body = orjson.dumps(error.body())
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
        ]
        headers += [(k.lower().encode(), v.encode()) for k, v in error.headers().items()]
        await self._start(error.status, headers)
        await self._send({"type": "http.response.body", "body": body, "more_body": False})


class Supervisor:
    """Watches one request: client disconnect, keep-alive, deadlines. See the module doc."""

    def __init__(
        self,
        *,
        task: asyncio.Task[Any],
        receive: Receive,
        downstream: Downstream,
        timeouts: TimeoutConfig,
        clock: Clock,
    ) -> None:
        self._task = task
        self._receive = receive
        self._down = downstream
        self._clock = clock
        self.clock = clock
        self._keepalive_s = timeouts.keepalive_s if downstream.stream else None
        self._first_byte_s = timeouts.first_byte_s
        self._idle_s = timeouts.idle_s
        now = clock()
        self._total_deadline = now + timeouts.total_s if timeouts.total_s else None
        self._attempt_start = now
        self.attempting = False  # deadlines apply only while an upstream attempt runs
        self.receiving = False  # the current attempt has its response headers
        self.last_rx = now  # set by the relay on every upstream chunk (one clock read)
        self.reason: str | None = None
        self.closed = False
        self.disconnected = False
        # Set by the proxy while an upstream attempt runs: aborts it on its worker.
        self.abort_attempt: Callable[[], Awaitable[None]] | None = None
        self.attempt_aborted = False
        self._runner: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._runner = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        self.closed = True
        if self._runner is not None:
            self._runner.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._runner

    def begin_attempt(self) -> None:
        self._attempt_start = self.last_rx = self._clock()
        self.receiving = False
        self.attempting = True
        self.attempt_aborted = False

    def end_attempt(self) -> None:
        self.attempting = False
        self.abort_attempt = None

    def clear(self) -> None:
        """The request task has handled a timeout trip; keep supervising."""
        self.reason = None
        if self._runner is None or self._runner.done():
            self.start()

    def _deadline(self) -> float:
        if not self.attempting:
            return self._total_deadline or float("inf")
        if self.receiving:
            deadline = self.last_rx + self._idle_s
        else:
            deadline = self._attempt_start + self._first_byte_s
        if self._total_deadline is not None:
            deadline = min(deadline, self._total_deadline)
        return deadline

    def _next_wake(self) -> float:
        wake = self._deadline()
        if self._keepalive_s is not None:
            wake = min(wake, max(self.last_rx, self._down.last_tx) + self._keepalive_s)
        return wake

    async def _abort_then_trip(self, reason: str) -> bool:
        """Abort the running attempt on its worker, then cancel the request task."""
        abort, self.abort_attempt = self.abort_attempt, None
        if abort is not None and not self.closed:
            # Before the request task is cancelled: cancelling it mid-request makes httpx drop
            # the upstream connection at once, and the worker should hear "abort", not a hang-up.
            self.attempt_aborted = True
            await abort()
            if reason == TIMEOUT and not self.attempting:
                return False  # the attempt finished meanwhile: nothing left to time out
        self._trip(reason)
        return True

    def _trip(self, reason: str) -> None:
        if not self.closed and self.reason is None:
            self.reason = reason
            self._task.cancel()

    async def _run(self) -> None:
        receiving: asyncio.Future[Message] = asyncio.ensure_future(self._receive())
        try:
            while True:
                delay = self._next_wake() - self._clock()
                if delay > 0:
                    await asyncio.wait(
                        (receiving,), timeout=None if delay == float("inf") else delay
                    )
                if receiving.done():
                    try:
                        gone = receiving.result().get("type") == "http.disconnect"
                    except Exception:  # a receive that fails means the client is unreachable
                        gone = True
                    if gone:
                        self.disconnected = True
                        await self._abort_then_trip(DISCONNECT)
                        return
                    receiving = asyncio.ensure_future(self._receive())
                    continue
                now = self._clock()
                if now >= self._deadline() and await self._abort_then_trip(TIMEOUT):
                    return
                if self._keepalive_s is not None:
                    quiet = now - max(self.last_rx, self._down.last_tx)
                    if quiet >= self._keepalive_s and not self.closed:
                        await self._down.keepalive()
        finally:
            receiving.cancel()
