"""Everything the gateway needs from uvicorn beyond its public ``Config``/``Server``, in one place.

uvicorn's httptools protocol and its per-request ``RequestResponseCycle`` are not public API: their
attributes (``cycle.response_started``, ``flow.write_paused``, ``server_state.connections``...)
may change in any release. This module is the only one that touches them; the versions it was
checked against are pinned in ``pyproject.toml`` and ``tests/server/test_uvicorn_contract.py``
names any attribute a new release lacks.

``HttpConnection`` is uvicorn's protocol seen through a few hooks, named for what happens on the
connection (``opened``, ``read_done``, ``head_began``, ``head_piece``, ``head_completed``,
``message_completed``, ``closed``, ``unparsable``), and a few services (``respond_and_close``,
``stop_request``, ``open_connections``, ``target``). ``app.server.guard`` fills in the hooks.

``ResponseLane`` is one request's chunked body writes straight to the transport
(``app.proxy.direct.DirectBody``). ``Server`` is ``uvicorn.Server`` with its signal handling
open to a subclass (``intercept``) or left to another server in the same loop
(``owns_signals = False``).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

# After a refusal the connection is half-closed and what the client still sends is read and
# dropped for a moment, so the kernel does not answer it with a reset that destroys the refusal
# before the client reads it; then (or past this many dropped bytes) it is closed.
LINGER_S = 1.0
LINGER_BYTES = 1 << 20


class ResponseLane:
    """Chunked body writes on one request's connection (``cycle``: uvicorn's request cycle)."""

    __slots__ = ("_cycle", "_flow", "_on_gone", "_transport")

    def __init__(self, cycle: RequestResponseCycle) -> None:
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


class HttpConnection(HttpToolsProtocol):
    """uvicorn's httptools protocol for one client connection, with hooks (no-ops here)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._lingering: asyncio.TimerHandle | None = None
        self._dropped = 0

    # -- hooks --------------------------------------------------------------------------------
    def opened(self) -> None:
        """The connection was accepted."""

    def read_done(self, size: int) -> None:
        """``size`` bytes were read and parsed (not called once the connection is refused)."""

    def head_began(self) -> None:
        """A request's first byte was parsed."""

    def head_piece(self, size: int) -> None:
        """A piece of the request target or a whole header line was parsed (may raise to stop
        parsing: the request is then ``unparsable``)."""

    def head_completed(self, lane: ResponseLane | None) -> None:
        """The request's headers are complete and its ASGI call is scheduled (``lane``: its
        direct body writes; None for an upgrade)."""

    def message_completed(self) -> None:
        """The request's body is complete."""

    def closed(self) -> None:
        """The connection is gone."""

    def unparsable(self) -> None:
        """The request could not be parsed (or a ``head_piece`` hook stopped it): answer it."""
        super().send_400_response("Invalid HTTP request received.")

    # -- services -----------------------------------------------------------------------------
    def open_connections(self) -> int:
        """Connections this server holds open now, this one included."""
        return len(self.connections)

    def target(self) -> bytes:
        """The current request's target as parsed so far (b"" before its first byte)."""
        url: bytes = getattr(self, "url", b"")
        return url

    def peer(self) -> str:
        client = self.client
        return f"{client[0]}:{client[1]}" if client else "unknown"

    def stop_request(self) -> bool:
        """Stop the current request. Its application sees a disconnect from now on and what it
        sends is dropped; True. If its response is already under way it is left to finish, the
        connection is read no more and closed after it; False."""
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            if cycle.response_started:
                cycle.keep_alive = False
                self.flow.pause_reading()
                return False
            cycle.disconnected = True
            cycle.message_event.set()
        return True

    def respond_and_close(self, raw: bytes) -> None:
        """Write ``raw`` (a whole HTTP response) and close: half-close at once, drop what the
        client still sends for up to ``LINGER_S``, then close."""
        transport = self.transport
        if transport is None or transport.is_closing() or self._lingering is not None:
            return
        transport.write(raw)
        if not transport.can_write_eof():
            transport.close()
            return
        transport.write_eof()
        self._lingering = self.loop.call_later(LINGER_S, transport.close)
        self.flow.resume_reading()

    def close(self) -> None:
        transport = self.transport
        if transport is not None and not transport.is_closing():
            transport.close()

    # -- uvicorn's protocol, overridden to call the hooks ------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.opened()

    def data_received(self, data: bytes) -> None:
        if self._lingering is not None:  # refused: drop it
            self._dropped += len(data)
            if self._dropped > LINGER_BYTES:
                self.transport.close()
            return
        super().data_received(data)
        if self._lingering is None and not self.transport.is_closing():
            self.read_done(len(data))

    def connection_lost(self, exc: Exception | None) -> None:
        if self._lingering is not None:
            self._lingering.cancel()
        super().connection_lost(exc)
        self.closed()

    def send_400_response(self, msg: str) -> None:
        self.unparsable()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self.head_began()

    def on_url(self, url: bytes) -> None:
        self.head_piece(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self.head_piece(len(name) + len(value) + 4)
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        super().on_headers_complete()
        cycle = self.cycle
        upgrade = cycle is None or cycle.scope is not self.scope
        self.head_completed(None if upgrade else ResponseLane(cycle))

    def on_message_complete(self) -> None:
        self.message_completed()
        super().on_message_complete()


class Server(uvicorn.Server):
    """``uvicorn.Server``; ``started`` and ``should_exit`` are its own (public) flags."""

    owns_signals = True  # False: another server in this loop handles SIGINT/SIGTERM

    def intercept(self, sig: int) -> bool:
        """A shutdown signal arrived: True if handled here, else uvicorn stops as usual."""
        return False

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if not self.intercept(sig):
            super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if self.owns_signals:
            with super().capture_signals():
                yield
        else:
            yield
