"""The client side of one proxied request.

``Downstream`` sends the response: SSE headers on the first byte, body chunks as they come, a JSON
error (any status) while nothing was sent, or an SSE error event + ``[DONE]`` once it was.
``send_error`` answers a whole request with an error. Errors and keep-alives take the shape of the
request's API (``app.proxy.surface``: OpenAI's unless told otherwise). ``headers`` (the key's
rate-limit headers) go out with the response's head, whatever it is.

Every byte leaves through the request's ``Writer`` (``app.proxy.writer``: ASGI ``send``, or the
gateway's own server's lane), chosen once. Under the gateway's server it also knows whether the
client is behind (``behind``: ``send`` would wait for it) and can hang up on it (``close``); the
request's supervisor uses both and never waits for the client itself.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence

from app.errors import GatewayError
from app.proxy.direct import DirectBody
from app.proxy.surface import OPENAI, ErrorShape
from app.proxy.writer import Message as Message
from app.proxy.writer import Send as Send
from app.proxy.writer import writer_for

Receive = Callable[[], Awaitable[Message]]
Clock = Callable[[], float]


class Downstream:
    __slots__ = (
        "_headers",
        "_request_id",
        "clock",
        "direct_lane",
        "last_tx",
        "shape",
        "started",
        "stream",
        "writer",
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
        self.writer = writer_for(send, direct)  # how the bytes leave, whatever the server
        self._headers = headers
        self.shape = shape
        self.direct_lane = direct  # the server's lane (app.proxy.direct), if any: its client
        self._request_id = request_id.encode("latin-1")
        self.stream = stream
        self.clock = clock
        self.started = False  # response headers sent: errors from now on go in-band
        self.last_tx = clock()

    def _begin(self, status: int, head: list[tuple[bytes, bytes]], body: bytes, more: bool) -> bool:
        """The response's head (``head`` and the request's own headers) with its first body
        piece; True: ``writer.flush()`` next."""
        self.started = True
        head.append((b"x-request-id", self._request_id))
        head += self._headers
        return self.writer.begin(status, head, body, more=more)

    def put(self, data: bytes) -> bool:
        """One piece of the SSE stream, without a wait (the first starts the response: its head
        and this piece in one write where the server's lane can); True: ``writer.flush()`` before
        the next."""
        if self.started:
            return self.writer.put(data)
        head = [
            (b"content-type", b"text/event-stream"),
            (b"cache-control", b"no-cache"),
            (b"x-accel-buffering", b"no"),
        ]
        return self._begin(200, head, data, True)

    async def chunk(self, data: bytes) -> None:
        """One piece of the SSE stream (``put``, then a wait if it must)."""
        if self.put(data):
            await self.writer.flush()

    def behind(self) -> bool:
        """The client is behind: what is sent now waits until it catches up. Always False
        without the server's lane (then nothing tells)."""
        return self.writer.behind()

    def pending(self) -> int:
        """Bytes sent and not yet taken by the client (0 without the server's lane)."""
        return self.writer.pending()

    def close(self) -> None:
        """Hang up on the client at once (it takes nothing more); without the server's lane the
        connection is closed when the request returns unfinished."""
        self.writer.close()

    def keepalive_now(self) -> bool:
        """``: keep-alive`` written straight to a started stream's connection, if the writer
        writes at once (never waits); False when it must be awaited (``keepalive``)."""
        if not self.started or not self.writer.immediate:
            return False
        self.writer.put(self.shape.keepalive)
        self.last_tx = self.clock()
        return True

    async def keepalive(self) -> None:
        """The keep-alive, awaited; skipped if the client is behind by now (checked with no
        wait between the check and the write, so it does not wait for the client under the
        gateway's server)."""
        if self.behind():
            return
        await self.chunk(self.shape.keepalive)
        self.last_tx = self.clock()

    async def end(self, last: bytes = b"") -> None:
        """The stream's end, after its ``last`` piece (one write with it)."""
        if not self.started:  # the whole stream came in the reads before the commit point
            await self.chunk(last)
            last = b""
        await self.writer.end(last)

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
        if self._begin(status, head, body, False):
            await self.writer.flush()

    async def fail(self, error: GatewayError) -> None:
        """The error as the whole response if nothing was sent yet, else in-band (OpenAI's: an
        error event + [DONE]; the shape's own otherwise)."""
        if self.started:  # one message: no wait for the client between the event and the end
            await self.writer.end(self.shape.error_events(error))
            return
        self.started = True
        status, head, body = error_response(error, self._request_id, self.shape)
        head += self._headers
        if self.writer.begin(status, head, body, more=False):
            await self.writer.flush()


def error_response(
    error: GatewayError, request_id: bytes, shape: ErrorShape = OPENAI
) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    """``error`` as a whole JSON response (``shape``'s): its status, its head (with the error's
    own headers: Retry-After) and its body."""
    body = shape.error_json(error)
    head = [
        (b"content-type", b"application/json"),
        (b"content-length", b"%d" % len(body)),
        (b"x-request-id", request_id),
    ]
    head += [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in error.headers().items()]
    return error.status, head, body


async def send_error(
    send: Send,
    error: GatewayError,
    request_id: bytes,
    shape: ErrorShape = OPENAI,
    extra: Sequence[tuple[bytes, bytes]] = (),
) -> None:
    """``error`` as a whole JSON response (``shape``'s), with its own headers (Retry-After) and
    ``extra``."""
    status, headers, body = error_response(error, request_id, shape)
    headers += extra
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})
