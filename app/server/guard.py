"""Hostile and slow clients, refused at the HTTP layer before any application code runs.

uvicorn's httptools protocol waits as long as a client likes for a request's headers and body,
keeps every header byte it is sent and accepts every connection: a few hundred connections
trickling bytes (slowloris), one header line that never ends, or thousands of idle connections
would hold sockets, memory and CPU forever. ``guarded_protocol`` returns a protocol class
(``app.server.uvicorn.protocol.HttpConnection`` with its hooks filled in) with these limits:

- at most ``max_connections`` open connections per server (process): one more is answered 503
  at once, without reading its request;
- the request line and headers must be complete within ``header_s`` of the connection opening (or
  of the request's first byte, on a kept-alive connection: uvicorn's own keep-alive timeout covers
  the idle time between requests);
- the body within ``body_s`` of the headers;
- a pipelined request (sent before the answer to the one ahead of it ended) is not read until
  that answer ends: its clocks start then; at most ``max_pipelined`` requests (the one answering
  included) are read ahead on one connection, the rest waits unread
  (``HttpConnection.max_pipelined``);
- the head (request line, headers, blank line) at most ``max_header_bytes``, counted as bytes
  arrive (``HttpConnection.head_size``): a header line that never ends is refused once it passes
  the limit, not buffered, and the verdict does not depend on how the head was split into reads.

Over a limit the client gets a 408, 431 or 503 (JSON in the shape of the target's API: ``Shape``,
handed in by ``app.server.run`` from the surface registry, OpenAI's by default; ``Connection:
close``, an ``X-Request-Id``) if nothing was answered yet, and the connection is closed; a response
already under way is left to finish (the request's own: no second answer; an earlier pipelined
one's: the refusal follows it, never in its midst). An unparsable request gets a 400 the same way.
Each such answer is reported (``Report``: an access-log line and ``requests_total``), and only
there: the stopped request's application records nothing (``ResponseLane.stopped``). A connection on
which no request began is closed without an answer (a client that opened it early must not read a
408 as the answer to the request it sends later). Every response has a write deadline too: once its
bytes wait in the connection's write buffer (over the buffer's high-water mark, or left there when
the response or refusal ended), the client must take some within ``write_s``, and again within each
``write_s`` after, or the connection is closed at once (what is buffered dropped) and counted
(``stalled``): a client that never reads cannot pin a connection slot, a request task or the
buffered bytes. A started stream is left to its relay's own slow-reader guard (``timeouts.idle_s``).

The cost is one timer per request phase left unfinished by a read (``loop.call_at``; none for a
request that arrives whole), one per response whose bytes the client has not taken yet (none when
the kernel took them at once), nothing per body chunk.

The protocol also offers each request the ``app.proxy.direct`` extension (stream chunks written
without ASGI ``send``).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from app.errors import (
    GatewayError,
    HeadersTooLarge,
    InvalidRequest,
    RequestTimeout,
    ServiceUnavailable,
)
from app.proxy.direct import EXTENSION
from app.proxy.surface import OPENAI, ErrorShape
from app.server.uvicorn.lane import ResponseLane
from app.server.uvicorn.protocol import HttpConnection

log = logging.getLogger(__name__)

_REASONS = {
    400: b"Bad Request",
    408: b"Request Timeout",
    431: b"Request Header Fields Too Large",
    503: b"Service Unavailable",
}

# (request target as parsed so far, request id, the answer): one refused request.
Report = Callable[[bytes, str, GatewayError], None]
# The error shape of a request target's API (its path's).
Shape = Callable[[bytes], ErrorShape]


def _no_report(target: bytes, request_id: str, error: GatewayError) -> None:
    pass


def _no_count() -> None:
    pass


def _openai(target: bytes) -> ErrorShape:
    return OPENAI


@dataclass(frozen=True, slots=True)
class GuardLimits:
    header_s: float
    body_s: float
    max_header_bytes: int
    max_connections: int = 4096
    retry_after_s: int = 1  # on the 503 for a connection over max_connections
    max_pipelined: int = 16  # requests read ahead on one connection (HttpConnection)
    write_s: float = 60.0  # a response's bytes left unread this long, no progress: closed


class _HeadersOverLimit(Exception):
    """Raised in a parser callback: stops parsing (see ``unparsable``)."""


class GuardedConnection(HttpConnection):
    limits = GuardLimits(header_s=10.0, body_s=60.0, max_header_bytes=64 * 1024)
    report: Report = staticmethod(_no_report)
    stalled: Callable[[], None] = staticmethod(_no_count)  # a connection closed by write_s
    shape: Shape = staticmethod(_openai)  # the error shape of a refusal, by request target

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # The write deadline: armed while bytes wait unsent, with what waited when it was armed
        # and whether the client took bytes since (``writes_moved``).
        self._writing: asyncio.TimerHandle | None = None
        self._write_mark = 0
        self._write_moved = False
        self._guard: asyncio.TimerHandle | None = None
        # The current phase's deadline (loop time) and what to do then; the timer is (re)armed
        # only after a read that leaves a phase unfinished, so a request that arrives whole in
        # one read costs no timer at all.
        self._want: tuple[float, Callable[[], None]] | None = None
        self._armed: tuple[float, Callable[[], None]] | None = None
        # A phase (its length, what to do then) whose clock has not started: the request waits
        # behind an earlier response on the connection and cannot be read until that ends.
        self._deferred: tuple[float, Callable[[], None]] | None = None
        self._begun = False  # a request's first byte arrived and its headers are not complete

    # Timer plumbing
    def _expect(self, delay: float, callback: Callable[[], None]) -> None:
        if self.waiting():
            self._want, self._deferred = None, (delay, callback)
        else:
            self._want, self._deferred = (self.loop.time() + delay, callback), None

    def _sync(self) -> None:
        want = self._want
        if want is self._armed:
            return
        self._disarm()
        if want is not None:
            self._guard = self.loop.call_at(want[0], want[1])
            self._armed = want

    def _disarm(self) -> None:
        self._armed = None
        if self._guard is not None:
            self._guard.cancel()
            self._guard = None

    # Hooks
    def opened(self) -> None:
        if self.open_connections() > self.limits.max_connections:
            self._refuse(
                ServiceUnavailable(
                    "the gateway has too many open connections; retry shortly",
                    retry_after=self.limits.retry_after_s,
                )
            )
            return
        self._expect(self.limits.header_s, self._headers_too_slow)
        self._sync()

    def read_done(self, size: int) -> None:
        if self._begun and self.head_size > self.limits.max_header_bytes:
            self._too_large()
            return
        self._sync()

    def closed(self) -> None:
        self._want = self._deferred = None
        self._disarm()
        if self._writing is not None:
            self._writing.cancel()
            self._writing = None

    def writes_pending(self) -> None:
        if self._writing is None:
            self._watch_writes()

    def writes_moved(self) -> None:
        self._write_moved = True

    def response_ended(self) -> None:
        deferred = self._deferred
        if deferred is not None and not self.waiting():
            self._expect(*deferred)
            self._sync()

    def unparsable(self) -> None:
        # httptools reports an exception raised in a callback as a parse error.
        if self.head_size > self.limits.max_header_bytes:
            self._too_large()
        else:
            self._refuse(InvalidRequest("the request is not valid HTTP/1.1", code="bad_request"))

    def head_began(self) -> None:
        self._begun = True
        if self._want is None and self._deferred is None:  # a kept-alive connection's next one
            self._expect(self.limits.header_s, self._headers_too_slow)

    def head_measured(self) -> None:
        if self.head_size > self.limits.max_header_bytes:
            raise _HeadersOverLimit

    def head_completed(self, lane: ResponseLane | None) -> None:
        self._begun = False
        if lane is not None:
            # The relay's lane around ASGI send for stream chunks (app.proxy.direct).
            extensions: dict[str, Any] = self.scope.setdefault("extensions", {})
            extensions[EXTENSION] = lane
        self._expect(self.limits.body_s, self._body_too_slow)

    def message_completed(self) -> None:
        self._want = self._deferred = None

    # Limits
    def _watch_writes(self) -> None:
        self._write_mark, self._write_moved = self.unsent(), False
        self._writing = self.loop.call_later(self.limits.write_s, self._writes_due)

    def _writes_due(self) -> None:
        """``write_s`` after bytes were left waiting: closed if the client took none since."""
        self._writing = None
        unsent = self.unsent()
        transport = self.transport
        if unsent == 0 or transport is None:
            return
        if self._write_moved or unsent < self._write_mark or self.streaming():
            self._watch_writes()  # it took some (a started stream's relay judges its own client)
            return
        log.info(
            "closing the connection from %s: %d response bytes not taken for %.0f s",
            self.peer(),
            unsent,
            self.limits.write_s,
        )
        self.stalled()
        self.abort()

    def _too_large(self) -> None:
        limit = self.limits.max_header_bytes
        self._refuse(HeadersTooLarge(f"request headers are larger than {limit} bytes"))

    def _headers_too_slow(self) -> None:
        self._guard = self._armed = self._want = None
        if not self._begun:  # idle: nothing to answer
            self.close()
            return
        self._refuse(RequestTimeout("the request headers were not received in time"))

    def _body_too_slow(self) -> None:
        self._guard = self._armed = self._want = None
        self._refuse(RequestTimeout("the request body was not received in time"))

    def _refuse(self, error: GatewayError) -> None:
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        log.info("closing the connection from %s: %s", self.peer(), error.message)
        self._want = self._deferred = None
        self._disarm()
        if not self.stop_request():  # an answer is under way: it finishes, then the close
            return
        request_id = os.urandom(16).hex()
        self.report(self.target(), request_id, error)
        target = self.target()
        self.respond_and_close(_raw_response(error, request_id, self.shape(target)))


def _raw_response(error: GatewayError, request_id: str, shape: ErrorShape = OPENAI) -> bytes:
    """The whole answer, its body in ``shape`` (that of the API the target belongs to)."""
    body = shape.error_json(error)
    reason = _REASONS.get(error.status, b"Error")
    extra = b"".join(
        b"%s: %s\r\n" % (k.lower().encode("latin-1"), v.encode("latin-1"))
        for k, v in error.headers().items()
    )
    return b"".join(
        [
            b"HTTP/1.1 %d %s\r\n" % (error.status, reason),
            b"content-type: application/json\r\n",
            b"content-length: %d\r\n" % len(body),
            b"x-request-id: %s\r\n" % request_id.encode("ascii"),
            extra,
            b"connection: close\r\n\r\n",
            body,
        ]
    )


def guarded_protocol(
    limits: GuardLimits,
    report: Report | None = None,
    stalled: Callable[[], None] | None = None,
    shape: Shape | None = None,
) -> type[GuardedConnection]:
    """The protocol class with these limits, for ``uvicorn.Config(http=...)``; ``report`` hears
    of every request it answers itself, ``stalled`` of every connection closed because its
    client took no response bytes for ``write_s``; ``shape`` gives the error shape of a request
    target's API (OpenAI's when not given)."""

    class Guarded(GuardedConnection):
        pass

    Guarded.limits = limits
    Guarded.max_pipelined = limits.max_pipelined
    if report is not None:
        Guarded.report = staticmethod(report)
    if stalled is not None:
        Guarded.stalled = staticmethod(stalled)
    if shape is not None:
        Guarded.shape = staticmethod(shape)
    return Guarded
