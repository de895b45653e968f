"""What differs between the API families the gateway serves over the same proxy.

A request's ``Surface`` (None: the OpenAI API, relayed as the worker sends it) is chosen once per
request, when it is parsed, never per chunk: it makes the stream's observer (``Observer``: the
relay's ``feed``/``finish`` shape, ``app.upstream.sse.SSEObserver`` for OpenAI), turns a
non-streamed worker answer into the client's, and renders errors and keep-alives
(``ErrorShape``). ``app.anthropic`` is the Messages API's surface.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import orjson

from app.errors import SSE_DONE, GatewayError

if TYPE_CHECKING:
    from app.proxy.request import ParsedRequest
    from app.upstream.sse import Usage


class Observer(Protocol):
    """Watches (and maybe rewrites) a worker's SSE stream on its way to the client."""

    first_data: bool  # a data event reached the client: the commit point
    done: bool  # the worker's stream ended properly
    after_done: bool  # the worker sent more after its end (never relayed)
    expect: str | None  # the rid the first event must answer (None: not checked)
    events: int
    usage: Usage | None
    inband_error: bool

    def feed(self, chunk: bytes) -> bytes:
        """The bytes to send the client for this upstream read (maybe empty)."""

    def finish(self) -> bytes:
        """The bytes to send for what the worker left unterminated at its end."""


class ErrorShape(Protocol):
    """How errors and keep-alives look to this API's clients."""

    keepalive: bytes

    def error_json(self, error: GatewayError) -> bytes:
        """The body of a whole error response (status ``error.status``)."""

    def error_events(self, error: GatewayError) -> bytes:
        """The stream's last bytes when it fails after it began."""


class OpenAIShape:
    keepalive = b": keep-alive\n\n"

    @staticmethod
    def error_json(error: GatewayError) -> bytes:
        return orjson.dumps(error.body())

    @staticmethod
    def error_events(error: GatewayError) -> bytes:
        return error.to_sse() + SSE_DONE


OPENAI = OpenAIShape()


class Surface(Protocol):
    shape: ErrorShape

    def observer(self, request: ParsedRequest, *, expose: bool) -> Observer:
        """The stream observer for one upstream attempt."""

    def whole(self, doc: dict[str, Any], request: ParsedRequest) -> bytes:
        """The client's body for a worker's non-streamed JSON answer ``doc`` (2xx)."""
