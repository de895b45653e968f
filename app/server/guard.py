"""Slow and oversized requests, refused at the HTTP layer before any application code runs.

uvicorn's httptools protocol waits as long as a client likes for a request's headers and body, and
keeps every header byte it is sent: a few hundred connections trickling bytes (slowloris) would hold
sockets and memory forever. ``guarded_protocol`` returns a subclass with three limits per request:

- the request line and headers must be complete within ``header_s`` of the connection opening (or
  of the request's first byte, on a kept-alive connection: uvicorn's own keep-alive timeout covers
  the idle time between requests);
- the body within ``body_s`` of the headers;
- request line + headers at most ``max_header_bytes``.

Over a limit the client gets a 408 or 431 (OpenAI-shaped JSON, ``Connection: close``) if nothing was
answered yet, and the connection is closed; a response already under way is left to finish. A
connection on which no request began is closed without an answer (a client that opened it early
must not read a 408 as the answer to the request it sends later). The cost is one timer per
request phase left unfinished by a read (``loop.call_at``; none for a request that arrives whole),
nothing per body chunk.

The protocol also offers each request the ``app.proxy.direct`` extension (stream chunks written
without ASGI ``send``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from app.errors import GatewayError, HeadersTooLarge, RequestTimeout
from app.proxy.direct import EXTENSION, DirectBody

log = logging.getLogger(__name__)

_REASONS = {408: b"Request Timeout", 431: b"Request Header Fields Too Large"}


@dataclass(frozen=True, slots=True)
class GuardLimits:
    header_s: float
    body_s: float
    max_header_bytes: int


class _HeadersOverLimit(Exception):
    """Raised in a parser callback: stops parsing (see ``send_400_response``)."""


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    limits = GuardLimits(header_s=10.0, body_s=60.0, max_header_bytes=64 * 1024)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._guard: asyncio.TimerHandle | None = None
        # The current phase's deadline (loop time) and what to do then; the timer is (re)armed
        # only after a read that leaves a phase unfinished, so a request that arrives whole in
        # one read costs no timer at all.
        self._want: tuple[float, Callable[[], None]] | None = None
        self._armed: tuple[float, Callable[[], None]] | None = None
        self._header_bytes = 0
        self._begun = False  # a request's first byte arrived and its headers are not complete
        self._directs: list[DirectBody] = []  # told when the connection is lost

    # Timer plumbing
    def _expect(self, delay: float, callback: Callable[[], None]) -> None:
        self._want = (self.loop.time() + delay, callback)

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

    # Connection and parser callbacks
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._expect(self.limits.header_s, self._headers_too_slow)
        self._sync()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._sync()

    def connection_lost(self, exc: Exception | None) -> None:
        self._want = None
        self._disarm()
        super().connection_lost(exc)
        for direct in self._directs:
            direct.gone()
        self._directs = []

    def send_400_response(self, msg: str) -> None:
        # httptools reports an exception raised in a callback as a parse error, answered 400.
        if self._header_bytes > self.limits.max_header_bytes:
            limit = self.limits.max_header_bytes
            self._refuse(HeadersTooLarge(f"request headers are larger than {limit} bytes"))
        else:
            super().send_400_response(msg)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._header_bytes = 0
        self._begun = True
        if self._want is None:  # a kept-alive connection's next request
            self._expect(self.limits.header_s, self._headers_too_slow)

    def on_url(self, url: bytes) -> None:
        self._count(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count(len(name) + len(value) + 4)
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._begun = False
        super().on_headers_complete()
        cycle = self.cycle
        if cycle is not None and cycle.scope is self.scope:  # not an upgrade
            # The relay's lane around ASGI send for stream chunks (app.proxy.direct).
            direct = DirectBody(cycle)
            extensions: dict[str, Any] = self.scope.setdefault("extensions", {})
            extensions[EXTENSION] = direct
            # Requests on this connection still answering (more than one only when pipelined).
            self._directs = [d for d in self._directs if not d.complete()]
            self._directs.append(direct)
        self._expect(self.limits.body_s, self._body_too_slow)

    def on_message_complete(self) -> None:
        self._want = None
        super().on_message_complete()

    def _count(self, size: int) -> None:
        self._header_bytes += size
        if self._header_bytes > self.limits.max_header_bytes:
            raise _HeadersOverLimit

    # Limits
    def _headers_too_slow(self) -> None:
        self._guard = self._armed = self._want = None
        if not self._begun:  # idle: nothing to answer
            if self.transport is not None and not self.transport.is_closing():
                self.transport.close()
            return
        self._refuse(RequestTimeout("the request headers were not received in time"))

    def _body_too_slow(self) -> None:
        self._guard = self._armed = self._want = None
        self._refuse(RequestTimeout("the request body was not received in time"))

    def _refuse(self, error: GatewayError) -> None:
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        log.info("closing the connection from %s: %s", _peer(self.client), error.message)
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            if cycle.response_started:
                # Let the answer under way finish; read nothing more, then close.
                cycle.keep_alive = False
                self.flow.pause_reading()
                return
            # The application is still waiting for the body: it sees a disconnect from now on
            # and whatever it sends is dropped.
            cycle.disconnected = True
            cycle.message_event.set()
        transport.write(_raw_response(error))
        transport.close()


def _peer(client: tuple[str, int] | None) -> str:
    return f"{client[0]}:{client[1]}" if client else "unknown"


def _raw_response(error: GatewayError) -> bytes:
    body = orjson.dumps(error.body())
    reason = _REASONS.get(error.status, b"Error")
    return b"".join(
        [
            b"HTTP/1.1 %d %s\r\n" % (error.status, reason),
            b"content-type: application/json\r\n",
            b"content-length: %d\r\n" % len(body),
            b"connection: close\r\n\r\n",
            body,
        ]
    )


def guarded_protocol(limits: GuardLimits) -> type[GuardedHttpToolsProtocol]:
    """The httptools protocol class with these limits, for ``uvicorn.Config(http=...)``."""

    class Guarded(GuardedHttpToolsProtocol):
        pass

    Guarded.limits = limits
    return Guarded
