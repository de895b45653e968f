"""One request's response written straight to its connection's transport, past uvicorn's ASGI
``send`` (``app.proxy.direct.DirectBody``), keeping uvicorn's request cycle as ``send`` leaves it:
chunked body writes of a started stream, or a whole response in one write. Like
``app.server.uvicorn.protocol`` it touches uvicorn's private request cycle (checked by name in
``tests/server/test_uvicorn_contract.py``).
"""

from __future__ import annotations

from collections.abc import Callable

from uvicorn.protocols.http.httptools_impl import STATUS_LINE, RequestResponseCycle


class ResponseLane:
    """Chunked body writes on one request's connection (``cycle``: uvicorn's request cycle)."""

    __slots__ = ("_cycle", "_flow", "_on_gone", "_stopped", "_transport")

    def __init__(self, cycle: RequestResponseCycle) -> None:
        self._cycle = cycle
        self._transport = cycle.transport
        self._flow = cycle.flow
        self._on_gone: Callable[[], None] | None = None
        self._stopped = False

    def stopped(self) -> bool:
        """The server answered this request itself (``HttpConnection.stop_request``): its
        application sees a disconnect and must neither answer nor record it."""
        return self._stopped

    def serves(self, cycle: RequestResponseCycle | None) -> bool:
        return self._cycle is cycle

    def stop(self) -> None:
        self._stopped = True
        self._cycle.disconnected = True
        self._cycle.message_event.set()

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

    def respond(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> bool:
        """A whole response (``headers`` with its content-length) in one write, head and body
        together, as uvicorn's ``send`` would write them in two; the request cycle's state is
        left as ``send`` leaves it. False (nothing done) when ``send`` must do it: the response
        began, the client is behind, a HEAD request, uvicorn's access log on."""
        cycle = self._cycle
        if self._declines(cycle):
            return False
        cycle.response_started = True
        cycle.waiting_for_100_continue = False
        if cycle.disconnected:  # dropped, as ``send`` drops it
            return True
        out = _head(cycle, status, headers)
        out += (b"\r\n", body)
        cycle.chunked_encoding = False
        cycle.expected_content_length = 0
        self._transport.write(b"".join(out))
        cycle.response_complete = True
        cycle.message_event.set()
        if not cycle.keep_alive:
            self._transport.close()
        cycle.on_response()
        return True

    def _declines(self, cycle: RequestResponseCycle) -> bool:
        """Whether ``send`` must write this response's head: it began, the client is behind, a
        HEAD request, uvicorn's access log on."""
        return bool(
            cycle.response_started
            or self._flow.write_paused
            or cycle.access_log
            or cycle.scope["method"] == "HEAD"
        )

    def heads(self, send: object) -> bool:
        """Whether ``send`` is this request's own (uvicorn's): then a head written here
        (``respond``, ``start_stream``) is the one ``send`` would write. A middleware's send
        (CORS adds its headers to the head) is not."""
        return getattr(send, "__self__", None) is self._cycle

    def start_stream(self, status: int, headers: list[tuple[bytes, bytes]], first: bytes) -> bool:
        """A chunked response's head and its first chunk (``first``, not empty) in one write,
        where ``send`` would write them in two; the request cycle is left as those two ``send``
        calls leave it. False (nothing done) when ``send`` must do it, as for ``respond``."""
        cycle = self._cycle
        if self._declines(cycle) or status in (204, 304):
            return False
        cycle.response_started = True
        cycle.waiting_for_100_continue = False
        cycle.chunked_encoding = True
        cycle.expected_content_length = 0
        if cycle.disconnected:  # dropped, as ``send`` drops it
            return True
        out = _head(cycle, status, headers)
        out += (b"transfer-encoding: chunked\r\n\r\n%x\r\n" % len(first), first, b"\r\n")
        self._transport.write(b"".join(out))
        return True

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
        return self._flow.write_paused

    async def drain(self) -> None:
        """Until the client has caught up (at once if it has gone)."""
        if self._flow.write_paused and not self._cycle.disconnected:
            await self._flow.drain()

    def behind(self) -> bool:
        """The connection's write buffer is over its high-water mark (``send`` would wait)."""
        return bool(self._flow.write_paused and not self._cycle.disconnected)

    def pending(self) -> int:
        transport = self._transport
        return 0 if transport.is_closing() else transport.get_write_buffer_size()

    def close(self) -> None:
        """Hang up at once (a reset: what the client has not taken is dropped). The request's
        ``receive`` reports a disconnect and its sends are dropped from now on."""
        cycle = self._cycle
        cycle.keep_alive = False
        if not cycle.response_complete:
            cycle.disconnected = True
            cycle.message_event.set()
        self._transport.abort()


def _head(
    cycle: RequestResponseCycle, status: int, headers: list[tuple[bytes, bytes]]
) -> list[bytes]:
    """A response head's status line and header lines (uvicorn's default headers first, then
    ``connection: close`` when the connection ends with it), without the blank line."""
    out = [STATUS_LINE[status]]
    for name, value in (*cycle.default_headers, *headers):
        out += (name, b": ", value, b"\r\n")
    if not cycle.keep_alive:
        out.append(b"connection: close\r\n")
    return out
