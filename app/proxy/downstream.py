"""The client side of one proxied request, in raw ASGI.

``Downstream`` sends the response: SSE headers on the first byte, body chunks as they come, a JSON
error (any status) while nothing was sent, or an SSE error event + ``[DONE]`` once it was.
``send_error`` answers a whole request with an error. Errors and keep-alives take the shape of the
request's API (``app.proxy.surface``: OpenAI's unless told otherwise). ``headers`` (the key's
rate-limit headers) go out with the response's head, whatever it is.

Under the gateway's own server (``app.proxy.direct``) it also knows whether the client is behind
(``behind``: ``send`` would wait for it) and can hang up on it (``close``); the request's
supervisor uses both and never waits for the client itself.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping, Sequence
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
        "_head_lane",
        "_headers",
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
        headers: Sequence[tuple[bytes, bytes]] = (),
    ) -> None:
        self._send = send
        self._headers = headers
        self.shape = shape
        self.direct_lane = direct  # the server's lane around send (app.proxy.direct), if any
        # The lane, when it may also write the response's head: ``send`` is the server's own.
        self._head_lane = direct if direct is not None and direct.heads(send) else None
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
        headers += self._headers
        await self._send({"type": "http.response.start", "status": status, "headers": headers})

    def _stream_head(self) -> list[tuple[bytes, bytes]]:
        return [
            (b"content-type", b"text/event-stream"),
            (b"cache-control", b"no-cache"),
            (b"x-accel-buffering", b"no"),
        ]

    async def start_stream(self) -> None:
        await self._start(200, self._stream_head())

    async def chunk(self, data: bytes) -> None:
        """One piece of the SSE stream (starts the response on the first call: with the
        server's lane, its head and this first piece in one write)."""
        if not self.started:
            lane = self._head_lane
            if lane is not None and data:
                head = self._stream_head()
                head.append((b"x-request-id", self._request_id))
                head += self._headers
                if lane.start_stream(200, head, data):
                    self.started = True
                    return
            await self.start_stream()
        await self._send({"type": "http.response.body", "body": data, "more_body": True})

    def behind(self) -> bool:
        """The client is behind: what is sent now waits until it catches up. Always False
        without the server's lane (then nothing tells)."""
        direct = self.direct_lane
        return direct is not None and direct.behind()

    def pending(self) -> int:
        """Bytes sent and not yet taken by the client (0 without the server's lane)."""
        direct = self.direct_lane
        return direct.pending() if direct is not None else 0

    def close(self) -> None:
        """Hang up on the client at once (it takes nothing more); without the server's lane the
        connection is closed when the request returns unfinished."""
        direct = self.direct_lane
        if direct is not None:
            direct.close()

    def keepalive_now(self) -> bool:
        """``: keep-alive`` written straight to a started stream's connection, if the lane is
        ready (never waits); False when it must go through ``send`` (``keepalive``)."""
        direct = self.direct()
        if direct is None:
            return False
        direct.write(self.shape.keepalive)
        self.last_tx = self.clock()
        return True

    async def keepalive(self) -> None:
        """The keep-alive through ``send``; skipped if the client is behind by now (checked
        with no wait between the check and the write, so it does not wait for the client under
        the gateway's server)."""
        if self.behind():
            return
        await self.chunk(self.shape.keepalive)
        self.last_tx = self.clock()

    async def end(self, last: bytes = b"") -> None:
        """The stream's end, after its ``last`` piece (one write with it)."""
        await self._send({"type": "http.response.body", "body": last, "more_body": False})

    async def complete(
        self,
        status: int,
        body: bytes,
        content_type: bytes,
        headers: list[tuple[bytes, bytes]] | None = None,
    ) -> None:
        """A whole non-streamed response (``headers``: more response headers)."""
        head = [
            (b"content-type", content_type),
            (b"content-length", b"%d" % len(body)),
            *(headers or ()),
        ]
        lane = self._head_lane
        if lane is not None and not self.started:
            self.started = True
            head.append((b"x-request-id", self._request_id))
            head += self._headers
            if lane.respond(status, head, body):
                return
            await self._send({"type": "http.response.start", "status": status, "headers": head})
        else:
            await self._start(status, head)
        await self._send({"type": "http.response.body", "body": body, "more_body": False})

    async def fail(self, error: GatewayError) -> None:
        """The error as the whole response if nothing was sent yet, else in-band (OpenAI's: an
        error event + [DONE]; the shape's own otherwise)."""
        if self.started:  # one message: no wait for the client between the event and the end
            body = self.shape.error_events(error)
            await self._send({"type": "http.response.body", "body": body, "more_body": False})
            return
        self.started = True
        await send_error(self._send, error, self._request_id, self.shape, self._headers)


async def send_error(
    send: Send,
    error: GatewayError,
    request_id: bytes,
    shape: ErrorShape = OPENAI,
    extra: Sequence[tuple[bytes, bytes]] = (),
) -> None:
    """``error`` as a whole JSON response (``shape``'s), with its own headers (Retry-After) and
    ``extra``."""
    body = shape.error_json(error)
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", b"%d" % len(body)),
        (b"x-request-id", request_id),
    ]
    headers += [
        (k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in error.headers().items()
    ]
    headers += extra
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})
