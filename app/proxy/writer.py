"""How one response's bytes leave for its client: a ``Writer``, chosen once per request
(``writer_for``), whatever the server.

Two of them: ``AsgiWriter`` sends every part through ASGI ``send`` (any server, an in-process
test client); ``LaneWriter``, under the gateway's own server (``app.proxy.direct``), writes a
whole response or a stream's head with its first piece in one write, and a started stream's body
pieces straight to the client's connection, from whatever runs them (the upstream read callback
included), falling back to ``send`` where the lane cannot write (see ``DirectBody``).

Writes do not wait: ``begin`` and ``put`` hand their bytes over and say whether the caller must
``await flush()`` before handing over more (a part kept for ``send``, or a client that is
behind). So the relay drives one writer the same way whether its bytes leave at once or through
``send``, and awaits only when they must wait.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any, Protocol

from app.proxy.direct import DirectBody

Message = MutableMapping[str, Any]
Send = Callable[[Message], Awaitable[None]]
Headers = list[tuple[bytes, bytes]]


class Writer(Protocol):
    """One response on its way to the client."""

    # ``put`` writes at once (never keeps a part for ``flush``): a started stream on the lane.
    immediate: bool
    # One more body piece of the begun response; True: ``await flush()`` before the next. An
    # attribute, not a method: on the lane it is the lane's own write (one call per chunk).
    put: Callable[[bytes], bool]

    def begin(self, status: int, headers: Headers, body: bytes, *, more: bool) -> bool:
        """The response's head and its first body piece (the whole body unless ``more``; a
        whole body's ``headers`` hold its content-length). True: ``await flush()`` next."""

    async def flush(self) -> None:
        """Out with the parts kept for ``send``, then until a client that is behind caught up."""

    async def end(self, last: bytes) -> None:
        """The body's ``last`` piece and its end (one message)."""

    def behind(self) -> bool:
        """The client is behind: what is written now waits until it catches up (always False
        where nothing tells)."""

    def pending(self) -> int:
        """Bytes written and not yet taken by the client (0 where nothing tells)."""

    def close(self) -> None:
        """Hang up on the client at once (it takes nothing more); where the server offers no
        way, the connection is closed when the request returns unfinished."""


class _Kept(list[Message]):
    """The messages kept for ``send`` until the writer is flushed."""

    __slots__ = ()

    def put(self, data: bytes) -> bool:
        self.append({"type": "http.response.body", "body": data, "more_body": True})
        return True


class AsgiWriter:
    """Every part through ``send``: ``begin`` and ``put`` keep their messages for ``flush``."""

    __slots__ = ("_kept", "_send", "immediate", "put")

    def __init__(self, send: Send) -> None:
        self._send = send
        self._kept = kept = _Kept()
        self.put: Callable[[bytes], bool] = kept.put
        self.immediate = False

    def begin(self, status: int, headers: Headers, body: bytes, *, more: bool) -> bool:
        self._kept += (
            {"type": "http.response.start", "status": status, "headers": headers},
            {"type": "http.response.body", "body": body, "more_body": more},
        )
        return True

    async def flush(self) -> None:
        await self._send_kept()

    async def _send_kept(self) -> None:
        kept = self._kept
        while kept:
            await self._send(kept.pop(0))

    async def end(self, last: bytes) -> None:
        await self._send_kept()
        await self._send({"type": "http.response.body", "body": last, "more_body": False})

    def behind(self) -> bool:
        return False

    def pending(self) -> int:
        return 0

    def close(self) -> None:
        pass


class LaneWriter(AsgiWriter):
    """The server's lane (``app.proxy.direct``) where it can write, ``send`` where it cannot:
    a head goes through ``send`` when a middleware's ``send`` adds to it (CORS), the client is
    behind, or the server's access log is on (``DirectBody.respond``); a stream's end always
    does, so the server's request cycle ends as ``send`` ends it. Once a stream is started on
    the lane, ``put`` is the lane's ``write``."""

    __slots__ = ("_heads", "_lane")

    def __init__(self, send: Send, lane: DirectBody) -> None:
        super().__init__(send)
        self._lane = lane
        self._heads = lane.heads(send)  # ``send`` is the server's own: the lane may write heads

    def begin(self, status: int, headers: Headers, body: bytes, *, more: bool) -> bool:
        lane = self._lane
        if self._heads and (
            (more and body and lane.start_stream(status, headers, body))
            or (not more and lane.respond(status, headers, body))
        ):
            if more:
                self._immediate()
            return False
        super().begin(status, headers, body, more=more)
        return True

    def _immediate(self) -> None:
        self.immediate = True
        self.put = self._lane.write

    async def flush(self) -> None:
        if self._kept:
            await self._send_kept()
            if self._lane.ready():  # a stream the lane goes on with
                self._immediate()
        if self.immediate:
            await self._lane.drain()

    def behind(self) -> bool:
        return self._lane.behind()

    def pending(self) -> int:
        return self._lane.pending()

    def close(self) -> None:
        self._lane.close()


def writer_for(send: Send, lane: DirectBody | None) -> Writer:
    """The request's writer: the server's lane when it offers one, else ``send``."""
    return AsgiWriter(send) if lane is None else LaneWriter(send, lane)
