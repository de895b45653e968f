"""A streamed response's body chunks written straight to the client's connection.

uvicorn's ASGI ``send`` costs a coroutine, a message dict and a handful of checks per body chunk,
and the relay must be a running task to await it: every upstream read wakes the request's task
just to pass the bytes on. Once a stream's headers went out through ``send`` (so uvicorn chose
chunked framing and keeps its own bookkeeping right), the relay can instead frame and write each
chunk from the upstream connection's read callback (``Http1Response.pump``): no task switch, no
message, one ``transport.write``. The end of the body (``0\\r\\n\\r\\n``) and anything sent after it
still go through ``send``.

The gateway's server protocol (``app.server.guard``) offers this per request as the ASGI scope
extension ``EXTENSION``; under any other server (or an in-process test client) it is absent and
the relay uses ``send``. It also tells the request when its client's connection is lost
(``watch``), so the proxy's supervisor needs no task waiting on ``receive()`` for that.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

EXTENSION = "dflash.direct_body"


class DirectBody:
    """Chunked body writes on one request's connection (``cycle``: uvicorn's request cycle)."""

    __slots__ = ("_cycle", "_flow", "_on_gone", "_transport")

    def __init__(self, cycle: Any) -> None:
        self._cycle = cycle
        self._transport = cycle.transport
        self._flow = cycle.flow
        self._on_gone: Callable[[], None] | None = None

    def watch(self, on_gone: Callable[[], None]) -> None:
        """Call ``on_gone`` (once) when the client's connection is lost: what a pending ASGI
        ``receive()`` would report as ``http.disconnect``, without a task waiting on it. At once
        if it is lost already; ``unwatch`` cancels."""
        if self._cycle.disconnected:
            on_gone()
        else:
            self._on_gone = on_gone

    def unwatch(self) -> None:
        self._on_gone = None

    def gone(self) -> None:
        """The server protocol's report: the connection was lost."""
        on_gone, self._on_gone = self._on_gone, None
        if on_gone is not None:
            on_gone()

    def ready(self) -> bool:
        """The response started with chunked framing and has not ended: writes may begin."""
        cycle = self._cycle
        return bool(
            cycle.response_started
            and cycle.chunked_encoding
            and not cycle.response_complete
            and cycle.scope["method"] != "HEAD"
        )

    def complete(self) -> bool:
        return bool(self._cycle.response_complete)

    def write(self, data: bytes) -> bool:
        """Write one body chunk. Returns True when the client is behind (the connection's write
        buffer is over its high-water mark): produce nothing more until ``drain()``. Bytes for a
        client that has gone are dropped, as ``send`` drops them."""
        transport = self._transport
        if self._cycle.disconnected or transport.is_closing():
            return False
        transport.write(b"%x\r\n%b\r\n" % (len(data), data))
        return self._flow.write_paused  # type: ignore[no-any-return]

    async def drain(self) -> None:
        """Until the client has caught up (at once if it has gone)."""
        if self._flow.write_paused and not self._cycle.disconnected:
            await self._flow.drain()


def direct_body(scope: Any) -> DirectBody | None:
    extensions = scope.get("extensions")
    return extensions.get(EXTENSION) if extensions else None
