"""A streamed response's body chunks written straight to the client's connection.

uvicorn's ASGI ``send`` costs a coroutine, a message dict and a handful of checks per body chunk,
and the relay must be a running task to await it: every upstream read wakes the request's task
just to pass the bytes on. Once a stream's headers went out through ``send`` (so the server chose
chunked framing and keeps its own bookkeeping right), the relay can instead frame and write each
chunk from the upstream connection's read callback (``Http1Response.pump``): no task switch, no
message, one ``transport.write``. The end of the body (``0\\r\\n\\r\\n``, with the stream's last
chunk) and anything sent after it still go through ``send``. A whole (non-streamed) response may
go out the same way, head and body in one write (``respond``), and so may a stream's head with
its first chunk (``start_stream``).

The gateway's server protocol (``app.server.guard``) offers this per request as the ASGI scope
extension ``EXTENSION`` (implemented by ``app.server.uvicorn.lane.ResponseLane``); under any
other server (or an in-process test client) it is absent and the relay uses ``send``. It also
tells the request when its client's connection is lost (``watch``), so the proxy's supervisor
needs no task waiting on ``receive()`` for that, whether the client is behind (``behind``, whatever
wrote last: ``send`` or the lane) and how much it has still to read (``pending``), and it can hang
up on a client that reads nothing (``close``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

EXTENSION = "dflash.direct_body"


class DirectBody(Protocol):
    """Chunked body writes on one request's connection."""

    def watch(self, on_gone: Callable[[], None]) -> None:
        """Call ``on_gone`` (once) when the client's connection is lost; at once if it is lost
        already. ``unwatch`` cancels."""

    def unwatch(self) -> None: ...

    def heads(self, send: object) -> bool:
        """Whether ``send`` is the server's own for this request: only then may ``respond`` and
        ``start_stream`` write a head in its place (a middleware's send may add headers)."""

    def respond(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> bool:
        """A whole response (``headers`` with its content-length) in one write where ``send``
        would write the head and the body apart; False when ``send`` must do it (the response
        began, the client is behind...)."""

    def start_stream(self, status: int, headers: list[tuple[bytes, bytes]], first: bytes) -> bool:
        """A stream's head (chunked framing) and its first chunk in one write; False when
        ``send`` must do it (as for ``respond``)."""

    def ready(self) -> bool:
        """The response started with chunked framing and has not ended: writes may begin."""

    def write(self, data: bytes) -> bool:
        """Write one body chunk; True when the client is behind: produce nothing more until
        ``drain()``. Bytes for a client that has gone are dropped."""

    async def drain(self) -> None:
        """Until the client has caught up (at once if it has gone)."""

    def stopped(self) -> bool:
        """The server answered this request itself (e.g. a 408 for a body sent too slowly) and
        recorded it: the application sees a disconnect and must neither answer nor record it."""

    def behind(self) -> bool:
        """The client is behind: its connection's write buffer is over the high-water mark (what
        ``write`` returning True and ``send`` waiting mean)."""

    def pending(self) -> int:
        """Bytes written for the client and not yet taken by it."""

    def close(self) -> None:
        """Hang up at once, dropping what the client has not taken: for a client that reads
        nothing. The request sees a disconnect from now on; what it sends is dropped."""


def direct_body(scope: Any) -> DirectBody | None:
    extensions = scope.get("extensions")
    return extensions.get(EXTENSION) if extensions else None
