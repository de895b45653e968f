"""The client side of one proxied request, in raw ASGI.

``Downstream`` sends the response: SSE headers on the first byte, body chunks as they come, a JSON
error (any status) while nothing was sent, or an SSE error event + ``[DONE]`` once it was.
``send_error`` answers a whole request with an error. Errors and keep-alives take the shape of the
request's API (``app.proxy.surface``: OpenAI's unless told otherwise).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from app.errors import GatewayError
from app.proxy.direct import DirectBody
from app.proxy.surface import OPENAI, ErrorShape

Message = MutableMapping[str, Any]
Send = Callable[[Message], Awaitable[None]]
Receive = Callable[[], Awaitable[Message]]
Clock = Callable[[], float]


class Downstream:
    __slots__ = (
        "_request_id",
        "_send",
        "clock",
        "direct_lane",
        "last_tx",
        "shape",
        "started",
        "stream",
    )

    def __init__(
        self,
        send: Send,
        request_id: str,
        *,
        stream: bool,
        clock: Clock,
        direct: DirectBody | None = None,
        shape: ErrorShape = OPENAI,
    ) -> None:
        self._send = send
        self.shape = shape
        self.direct_lane = direct  # the server's lane around send (app.proxy.direct), if any
        self._request_id = request_id.encode("latin-1")
        self.stream = stream
        self.clock = clock
        self.started = False  # response headers sent: errors from now on go in-band
        self.last_tx = clock()

    def direct(self) -> DirectBody | None:
        """Where stream chunks may be written without ``send`` from now on (``app.proxy.direct``);
        None if the server offers no such lane or the response is not a started stream."""
        direct = self.direct_lane
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
        await self.chunk(self.shape.keepalive)
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
        """The error as the whole response if nothing was sent yet, else in-band (OpenAI's: an
        error event + [DONE]; the shape's own otherwise)."""
        if self.started:
            await self.chunk(self.shape.error_events(error))
            await self.end()
            return
        self.started = True
        await send_error(self._send, error, self._request_id, self.shape)


async def send_error(
    send: Send, error: GatewayError, request_id: bytes, shape: ErrorShape = OPENAI
) -> None:
    """``error`` as a whole JSON response (``shape``'s), with its own headers (Retry-After)."""
    body = shape.error_json(error)
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", b"%d" % len(body)),
        (b"x-request-id", request_id),
    ]
    headers += [
        (k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in error.headers().items()
    ]
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})
