"""One keep-alive HTTP/1.1 connection to a worker: an asyncio Protocol feeding llhttp (httptools,
C), and the response currently arriving on it.

A worker's bytes are trusted as far as their framing goes and no further:

* a response ends where its framing (Content-Length, chunked, end of connection) says it ends,
  and nothing after that end is parsed into it. Any byte after the end, whether in the same read
  or a later one, and whether the response is still being read or the connection idles in the
  pool, *spoils* the connection: it is closed and never reused, so stray bytes can never become
  (part of) the answer to the next request sent on it. The response itself keeps exactly its
  own bytes. (Blank lines between responses are skipped by the parser, as HTTP/1.1 allows.)
* a head larger than ``MAX_HEAD_BYTES`` (counted as the bytes arrive, before the parser has
  buffered a whole header), a protocol switch (101), or bytes that do not parse as an HTTP/1.1
  response end the response with ``MalformedResponse`` and close the connection;
* the connection ending before the response did is ``ConnectionLost``.

Body bytes are kept as parsed, up to ``HIGH_WATER`` unread bytes (then the socket is not read:
TCP slows the worker down), and handed to whoever reads them: ``Http1Response`` in
``app.upstream.http1``, or its ``sink`` called right in ``data_received``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Sequence
from typing import cast

import httptools

from app.upstream.errors import ConnectionLost, MalformedResponse

HIGH_WATER = 64 * 1024  # unread body bytes before the socket stops being read
# The largest response head (status line and header fields) accepted from a worker; SGLang's
# are a few hundred bytes. Larger ones end the response as malformed.
MAX_HEAD_BYTES = 64 * 1024


class _StrayMessage(Exception):
    """Raised inside the parser to stop it where a second response would begin."""


class Connection(asyncio.Protocol):
    """One TCP connection to a worker and the response currently arriving on it."""

    __slots__ = (
        "body",
        "closed",
        "complete",
        "error",
        "fd",
        "head_read",
        "head_size",
        "headers",
        "headers_done",
        "idle_since",
        "in_use",
        "keep_alive",
        "key",
        "loop",
        "parser",
        "paused",
        "pending",
        "pool",
        "sink",
        "spoiled",
        "status",
        "transport",
        "until_close",
        "waiter",
    )

    def __init__(self) -> None:
        # Kept: asyncio.get_running_loop() costs a getpid() system call on Python < 3.12.
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.spoiled = False  # bytes arrived after the end of a response
        self.error: BaseException | None = None
        self.waiter: asyncio.Future[None] | None = None
        self.in_use = False  # a request is outstanding
        self.key = ("", 0)  # the pool it belongs to: host, port
        self.fd = -1  # the socket's descriptor, polled before the connection is reused
        self.idle_since = 0.0
        self.pool: list[Connection] | None = None  # the idle stack holding it, if any
        self.paused = False
        # Set while ``Http1Response.pump`` runs: body bytes go to it from ``data_received``.
        self.sink: Callable[[bytes], bool] | None = None
        self._reset()

    def _reset(self) -> None:
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.headers_done = False
        self.head_read = 0  # bytes of reads that did not complete the head
        self.head_size = 0  # bytes of the header fields parsed so far
        self.complete = False
        self.keep_alive = False
        self.until_close = False
        self.body: list[bytes] = []
        self.pending = 0  # bytes in ``body``

    # asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        if self.complete or not self.in_use:
            # After the end of the response, or while idle: the worker is out of step.
            self.spoil()
            return
        try:
            if self.headers_done:
                self.parser.feed_data(data)
            else:
                self._feed_head(data)
        except Exception as exc:  # httptools' errors, or a callback's (see on_message_begin)
            self._parse_failed(exc)
        sink = self.sink
        if sink is not None:
            body = self.body
            if body and not self.paused:
                # take(), inlined: this is the relay's per-chunk path.
                self.body = []
                self.pending = 0
                try:
                    behind = sink(body[0] if len(body) == 1 else b"".join(body))
                except Exception as exc:  # the consumer's failure ends this response (see pump)
                    self.error = exc
                    self.close()
                    behind = False
                if behind:
                    self.pause()
            if not (self.complete or self.paused or self.error is not None):
                return  # the pumping task has nothing to do: don't wake it
        elif self.pending > HIGH_WATER and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()
        self.wake()

    def _feed_head(self, data: bytes) -> None:
        """Feed bytes while the head is still arriving, counting them against the cap (the
        parser buffers a header field whole before ``on_header`` sees it)."""
        self.head_read += len(data)
        self.parser.feed_data(data)
        if not self.headers_done and self.head_read > MAX_HEAD_BYTES:
            raise MalformedResponse(f"response head over {MAX_HEAD_BYTES} bytes")

    def _parse_failed(self, exc: Exception) -> None:
        if self.complete:  # bytes after the end: the response stands, the connection goes
            self.spoil()
            return
        if isinstance(exc, httptools.HttpParserCallbackError):
            exc = exc.__context__ if isinstance(exc.__context__, Exception) else exc
        if isinstance(exc, httptools.HttpParserUpgrade):
            exc = MalformedResponse("the worker switched protocols")
        elif not isinstance(exc, MalformedResponse):
            exc = MalformedResponse(f"malformed response from the worker: {exc}")
        if self.error is None:
            self.error = exc
        self.close()

    def pause(self) -> None:
        if not self.paused and self.transport is not None and not self.closed:
            self.paused = True
            self.transport.pause_reading()

    def eof_received(self) -> bool:
        if self.until_close and self.headers_done:
            self.complete = True  # a body delimited by the end of the connection
        return False  # close the transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if not self.complete and self.error is None:
            if exc is None:
                self.error = ConnectionLost("the worker closed the connection")
            else:
                self.error = ConnectionLost(f"connection to the worker lost: {exc}")
        if self.pool is not None:
            with contextlib.suppress(ValueError):
                self.pool.remove(self)
            self.pool = None
        self.wake()

    # httptools callbacks

    def on_message_begin(self) -> None:
        if self.complete:
            raise _StrayMessage

    def on_header(self, name: bytes, value: bytes) -> None:
        self.head_size += len(name) + len(value) + 4
        if self.head_size > MAX_HEAD_BYTES:
            raise MalformedResponse(f"response head over {MAX_HEAD_BYTES} bytes")
        if not self.headers_done:  # trailer fields (after a chunked body) are not headers
            self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        if status < 200:  # an interim response (100 Continue): the real one follows
            self.headers = []
            return
        self.status = status
        self.headers_done = True
        framed = False
        for name, value in self.headers:
            lower = name.lower()
            if lower == b"content-length" or (
                lower == b"transfer-encoding" and b"chunked" in value.lower()
            ):
                framed = True
        self.until_close = not framed and status not in (204, 304)

    def on_body(self, body: bytes) -> None:
        self.body.append(body)
        self.pending += len(body)

    def on_message_complete(self) -> None:
        if self.headers_done:
            self.complete = True
            self.keep_alive = self.parser.should_keep_alive()

    # used by the client

    def wake(self) -> None:
        waiter = self.waiter
        if waiter is not None:
            self.waiter = None
            if not waiter.done():
                waiter.set_result(None)

    def take(self) -> bytes:
        """Everything parsed since the last call (the caller checked ``body`` is not empty)."""
        body = self.body
        data = body[0] if len(body) == 1 else b"".join(body)
        self.body = []
        self.pending = 0
        if self.paused:
            self.resume()
        return data

    def resume(self) -> None:
        self.paused = False
        if self.transport is not None and not self.closed:
            self.transport.resume_reading()

    def begin(self, request: bytes | Sequence[bytes | memoryview]) -> None:
        self.in_use = True
        self._reset()
        assert self.transport is not None
        if isinstance(request, bytes):
            self.transport.write(request)
        else:
            self.transport.writelines(request)

    def reusable(self) -> bool:
        return (
            self.complete
            and self.keep_alive
            and not self.closed
            and not self.until_close
            and self.error is None
            and not self.paused
        )

    def spoil(self) -> None:
        """The worker sent bytes that belong to no request: never use this connection again."""
        self.spoiled = True
        self.close()

    def close(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.close()
        self.closed = True
