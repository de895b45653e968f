"""uvicorn's httptools protocol for one client connection, seen through hooks and services.

uvicorn's httptools protocol and its per-request ``RequestResponseCycle`` are not public API: their
attributes (``cycle.response_started``, ``flow.write_paused``, ``server_state.connections``...)
may change in any release. This package (this module, ``server`` and ``lane``: one request's
response written past ``send``) is the only one that touches them; the versions it was checked
against are pinned in ``pyproject.toml`` and ``tests/server/test_uvicorn_contract.py`` names any
attribute a new release lacks.

``HttpConnection`` is uvicorn's protocol seen through a few hooks, named for what happens on the
connection (``opened``, ``read_done``, ``head_began``, ``head_measured``, ``head_completed``,
``message_completed``, ``response_ended``, ``writes_pending``, ``writes_moved``, ``closed``,
``unparsable``), and a few services (``respond_and_close``, ``stop_request``, ``waiting``,
``open_connections``, ``target``, ``unsent``, ``streaming``, ``abort``).
``app.server.guard`` fills in the hooks.

Pipelining costs constant work per request: the requests still answering are a queue
(``_lanes``, completed ones popped from its left), and at most ``max_pipelined`` of them (the one
answering included) are read ahead on one connection. A read that holds more requests is parsed
up to that many and its rest kept unparsed (at most one read: reading pauses meanwhile); it is
parsed as answers end, like uvicorn's own flow control for one queued request. A read is parsed
in pieces only when it holds more than one head end (``\r\n\r\n``), each piece ending at one (a
request that arrives whole is parsed in one piece as before), and kept back only between two
requests, never inside one's body.

``head_size`` is the raw size of the request's head as bytes arrive (``app.server.uvicorn.head``).
``ResponseLane`` (``app.server.uvicorn.lane``) is one request's chunked body writes, or its whole
response, straight to the transport (``app.proxy.direct.DirectBody``).
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from app.server.uvicorn.head import HeadMeter
from app.server.uvicorn.lane import ResponseLane

# After a refusal the connection is half-closed and what the client still sends is read and
# dropped for a moment, so the kernel does not answer it with a reset that destroys the refusal
# before the client reads it; then (or past this many dropped bytes) it is closed.
LINGER_S = 1.0
LINGER_BYTES = 1 << 20
_HEAD_END = b"\r\n\r\n"


class HttpConnection(HttpToolsProtocol):
    """uvicorn's httptools protocol for one client connection, with hooks (no-ops here)."""

    # Requests read ahead on one connection (the one answering included); past it the rest is
    # parsed only as answers end, and the connection is not read meanwhile.
    max_pipelined = 16

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._lingering: asyncio.TimerHandle | None = None
        self._dropped = 0
        self._in_head = False  # a request's first byte was parsed, its headers are not complete
        self._in_message = False  # ... its body is not complete (a read is only cut between two)
        # Requests on this connection still answering, oldest first (more than one only when
        # pipelined: uvicorn answers them in order).
        self._lanes: deque[ResponseLane] = deque()
        # The rest of a read beyond max_pipelined requests, not parsed yet: _unread[_unread_at:]
        # (an offset, so taking one request off the front does not copy the rest).
        self._unread = b""
        self._unread_at = 0
        self._feeding = False  # a deferred parse of ``_unread`` is scheduled
        self._held: bytes | None = None  # a refusal waiting for an earlier response to end
        self.head_size = 0  # raw bytes of the current request's head so far
        self._head = HeadMeter()
        # When the connection's last response ended with nothing after it (None: a request is
        # being read or answered): the keep-alive timeout counts from here (``_keep_alive_due``).
        self._idle_at: float | None = None

    # -- hooks --------------------------------------------------------------------------------
    def opened(self) -> None:
        """The connection was accepted."""

    def read_done(self, size: int) -> None:
        """``size`` bytes were read and parsed (not called once the connection is refused)."""

    def head_began(self) -> None:
        """A request's first byte was parsed."""

    def head_measured(self) -> None:
        """The request's head is complete and ``head_size`` is its final size; called before the
        request is handed on (may raise to stop parsing: the request is then ``unparsable``)."""

    def head_completed(self, lane: ResponseLane | None) -> None:
        """The request's headers are complete and its ASGI call is scheduled (``lane``: its
        direct body writes; None for an upgrade)."""

    def message_completed(self) -> None:
        """The request's body is complete."""

    def response_ended(self) -> None:
        """A response ended and the connection is open: the next request, if one is queued
        behind it, is now answered and read."""

    def writes_pending(self) -> None:
        """Bytes wait in the connection's write buffer (``unsent``): it passed its high-water
        mark, a response or a refusal ended with bytes still buffered."""

    def writes_moved(self) -> None:
        """The write buffer drained below its low-water mark: the client is taking bytes."""

    def closed(self) -> None:
        """The connection is gone."""

    def unparsable(self) -> None:
        """The request could not be parsed (or a ``head_measured`` hook stopped it): answer it."""
        super().send_400_response("Invalid HTTP request received.")

    # -- services -----------------------------------------------------------------------------
    def open_connections(self) -> int:
        """Connections this server holds open now, this one included."""
        return len(self.connections)

    def target(self) -> bytes:
        """The current request's target as parsed so far (b"" before its first byte)."""
        url: bytes = getattr(self, "url", b"")
        return url

    def unsent(self) -> int:
        """Bytes written to the connection that the kernel has not taken yet."""
        transport = self.transport
        return 0 if transport is None else transport.get_write_buffer_size()

    def streaming(self) -> bool:
        """The request answering now is a started stream (its relay guards its own client)."""
        lanes = self._unanswered()
        return bool(lanes) and lanes[0].ready()

    def abort(self) -> None:
        """Hang up at once, dropping what is buffered (``close`` would wait to flush it)."""
        transport = self.transport
        if transport is not None:
            transport.abort()

    def peer(self) -> str:
        client = self.client
        return f"{client[0]}:{client[1]}" if client else "unknown"

    def waiting(self) -> bool:
        """An earlier request's response on this connection is not complete: the current request
        (or the head being read) waits behind it."""
        lanes = self._unanswered()
        return bool(lanes) and not lanes[0].serves(None if self._in_head else self.cycle)

    def unanswered(self) -> int:
        """Requests read on this connection whose responses are not complete."""
        return len(self._unanswered())

    def _unanswered(self) -> deque[ResponseLane]:
        # uvicorn answers pipelined requests in order: the completed ones are at the left.
        lanes = self._lanes
        while lanes and lanes[0].complete():
            lanes.popleft()
        return lanes

    def stop_request(self) -> bool:
        """Stop the current request so that the server answers it: True. Its application (running
        or queued behind an earlier request) sees a disconnect from now on, what it sends is
        dropped and it records nothing (``ResponseLane.stopped``); a head still being read has no
        application yet, and earlier requests are left to finish. False when the request has an
        answer of its own: one under way is left to finish, the connection is read no more and
        closed after it; a complete one (sent before the body came) closes the connection now."""
        cycle = None if self._in_head else self.cycle
        if cycle is None:
            return True
        if cycle.response_complete:
            self.close()
            return False
        if cycle.response_started:
            cycle.keep_alive = False
            self.flow.pause_reading()
            return False
        for lane in self._lanes:
            if lane.serves(cycle):
                lane.stop()
                self._lanes.remove(lane)
                break
        else:
            cycle.disconnected = True
            cycle.message_event.set()
        for queued in list(self.pipeline):
            if queued[0] is cycle:
                self.pipeline.remove(queued)
        return True

    def respond_and_close(self, raw: bytes) -> None:
        """Write ``raw`` (a whole HTTP response) and close: half-close at once, drop what the
        client still sends for up to ``LINGER_S``, then close. While an earlier response on the
        connection is under way nothing is written in its midst: the connection is read no more,
        and ``raw`` follows once the earlier responses ended."""
        transport = self.transport
        if transport is None or transport.is_closing() or self._lingering is not None:
            return
        if self.waiting():
            self._held = raw
            self.flow.pause_reading()
            return
        self._unread = b""
        transport.write(raw)
        if not transport.can_write_eof():
            transport.close()
            return
        transport.write_eof()
        self._lingering = self.loop.call_later(LINGER_S, transport.close)
        self.flow.resume_reading()
        if transport.get_write_buffer_size():
            self.writes_pending()

    def close(self) -> None:
        transport = self.transport
        if transport is not None and not transport.is_closing():
            transport.close()

    # -- uvicorn's protocol, overridden to call the hooks ------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.opened()

    def data_received(self, data: bytes) -> None:
        if self._lingering is not None or self._held is not None:  # refused: drop it
            self._dropped += len(data)
            if self._dropped > LINGER_BYTES:
                self.transport.close()
            return
        if self._unread:  # a read already under way when reading paused: behind the rest
            self._unread = self._unread[self._unread_at :] + data
            self._unread_at = 0
            self.flow.pause_reading()
            return
        self._feed(data)

    def _feed(self, data: bytes, start: int = 0) -> None:
        """Parse ``data[start:]`` up to ``max_pipelined`` unanswered requests; keep the rest."""
        end = len(data)
        boundary = data.find(_HEAD_END, start)
        while True:
            following = data.find(_HEAD_END, boundary + 4) if boundary >= 0 else -1
            cut = end if following < 0 else boundary + 4
            self._parse(data if start == 0 and cut == end else data[start:cut])
            if cut == end or self._stopped_reading():
                return
            start, boundary = cut, following
            if not self._in_message and self.unanswered() >= self.max_pipelined:
                self._unread, self._unread_at = data, start
                self.flow.pause_reading()
                return

    def _stopped_reading(self) -> bool:
        """Nothing more of this connection is parsed: refused, closing, or handed to another
        protocol (an upgrade)."""
        transport = self.transport
        return (
            self._lingering is not None
            or self._held is not None
            or transport.is_closing()
            or transport.get_protocol() is not self
        )

    def _feed_unread(self) -> None:
        """Answers ended: parse what was kept of the last read, then read on."""
        self._feeding = False
        data, start, self._unread = self._unread, self._unread_at, b""
        if not data or self.parser is None or self._stopped_reading():
            return
        self._feed(data, start)
        if not self._unread and not self._stopped_reading() and not self.waiting():
            self.flow.resume_reading()

    def _parse(self, data: bytes) -> None:
        head = self._head
        head.reading(data)
        super().data_received(data)
        head.read()
        if self._lingering is None and self._held is None and not self.transport.is_closing():
            if self._in_head:
                self.head_size = head.incomplete(data)
            self.read_done(len(data))

    def connection_lost(self, exc: Exception | None) -> None:
        if self._lingering is not None:
            self._lingering.cancel()
        super().connection_lost(exc)
        if self.timeout_keep_alive_task is not None:
            self.timeout_keep_alive_task.cancel()
            self.timeout_keep_alive_task = None
        self._unread = b""
        lanes, self._lanes = self._lanes, deque()
        for lane in lanes:
            lane.gone()
        self.closed()

    def send_400_response(self, msg: str) -> None:
        self.unparsable()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_head = self._in_message = True
        self._head.began()
        self.head_size = 0
        self.head_began()

    def on_url(self, url: bytes) -> None:
        self._head.target(url)
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._head.header(name, value)
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self.head_size = self._head.complete(self.parser.get_method)
        self.head_measured()
        super().on_headers_complete()
        self._in_head = False
        cycle = self.cycle
        if cycle is None or cycle.scope is not self.scope:  # an upgrade
            self.head_completed(None)
            return
        lane = ResponseLane(cycle)
        self._unanswered().append(lane)
        self.head_completed(lane)

    def on_message_complete(self) -> None:
        self._in_message = False
        self._head.ended()
        self.message_completed()
        super().on_message_complete()

    def pause_writing(self) -> None:
        super().pause_writing()
        self.writes_pending()

    def resume_writing(self) -> None:
        super().resume_writing()
        self.writes_moved()

    def _unset_keepalive_if_required(self) -> None:
        # uvicorn cancels its keep-alive timer on every read and arms a new one after every
        # response; here the connection is marked busy and one timer, armed when it was idle,
        # is left to find that out when it fires (``_keep_alive_due``).
        self._idle_at = None

    def _keep_alive_due(self) -> None:
        """The keep-alive timer fired: close the connection if it has been idle for
        ``timeout_keep_alive`` since its last response, else wait for what is left (busy: the
        next response's end arms it again)."""
        self.timeout_keep_alive_task = None
        idle_at = self._idle_at
        if idle_at is None:
            return
        left = idle_at + self.timeout_keep_alive - self.loop.time()
        if left > 0:
            self.timeout_keep_alive_task = self.loop.call_later(left, self._keep_alive_due)
        else:
            self.timeout_keep_alive_handler()

    def on_response_complete(self) -> None:
        # uvicorn's, less a keep-alive timer armed and cancelled per request.
        self.server_state.total_requests += 1
        if not self.transport.is_closing():
            self.flow.resume_reading()
            if self.pipeline:
                cycle, app = self.pipeline.pop()
                self._start_asgi_task(cycle, app)
            else:
                self._idle_at = self.loop.time()
                if self.timeout_keep_alive_task is None:
                    self.timeout_keep_alive_task = self.loop.call_later(
                        self.timeout_keep_alive, self._keep_alive_due
                    )
        if self.transport.get_write_buffer_size():
            self.writes_pending()
        if self.transport.is_closing():
            return
        if self._held is None:
            self.response_ended()
            if self._unread:
                self.flow.pause_reading()  # uvicorn resumed it: the kept requests come first
                if not self._feeding:
                    self._feeding = True
                    self.loop.call_soon(self._feed_unread)
        elif self.waiting():
            self.flow.pause_reading()  # uvicorn resumed reading for the next queued request
        else:
            raw, self._held = self._held, None
            self.respond_and_close(raw)
