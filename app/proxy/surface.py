"""What differs between the API families the gateway serves over the same proxy.

Every request has a ``Surface``, chosen once, when it is parsed, never per chunk: the OpenAI
surfaces (``CHAT``, ``COMPLETIONS``: the worker's own API, relayed as the worker sends it) and
the translated ones (``app.anthropic``'s Messages) are peers. A surface makes the stream's
observer (``Observer``: the relay's ``feed``/``finish`` shape; ``app.upstream.sse.SSEObserver``
for OpenAI), turns a worker's non-streamed answer into the client's (``answer``), and renders
errors and keep-alives (``ErrorShape``). The table of every surface the gateway serves, with its
paths, is ``app.surfaces``.

A translated surface derives from ``TranslatedSurface``: it only says how a worker's answer,
parsed as a JSON document, becomes its client's body (``whole``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import orjson

from app.errors import SSE_DONE, GatewayError
from app.proxy.answer import NotJSON, read_answer
from app.upstream.sse import SSEObserver, answers, foreign
from app.upstream.usage import parse_usage, take_meta_info

if TYPE_CHECKING:
    from app.errors import UpstreamStatusError
    from app.proxy.request import ParsedRequest
    from app.upstream.usage import Usage

# A worker's non-streamed answer as the client gets it: its usage, its verify steps (exact,
# from ``meta_info``; None when not reported) and the client's body.
Answer = tuple["Usage | None", "int | None", bytes]


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

    def resumed(self) -> None:
        """The stream goes on from another attempt: drop what the broken one left unfinished."""

    # Holding back a worker-fault in-band error (``app.upstream.sse.StreamState``).
    holds_errors: bool
    hold_errors: bool
    broken: UpstreamStatusError | None

    def hold(self, chunk: bytes) -> bytes | None:
        """``chunk`` up to its first worker-fault error event (then ``broken``), or None."""


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

    def answer(self, body: bytes, request: ParsedRequest, rid: str | None) -> Answer:
        """A worker's non-streamed 2xx answer ``body`` as the client gets it; ``NotJSON`` when
        it is not a JSON object, ``UpstreamForeignAnswer`` when its ``id`` does not answer
        ``rid`` (None: nothing to check)."""


def read_document(
    body: bytes, *, strip: bool, rid: str | None
) -> tuple[dict[str, Any], Usage | None, int | None]:
    """A worker's answer as a JSON object, with its usage and verify steps (``meta_info`` taken
    out of its choices when ``strip``); ``NotJSON`` otherwise, ``UpstreamForeignAnswer`` when
    its ``id`` does not answer ``rid``."""
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        raise NotJSON from None
    if not isinstance(doc, dict):
        raise NotJSON
    if rid is not None and not answers(rid, doc.get("id")):
        raise foreign(rid, doc.get("id"))
    return doc, parse_usage(doc), take_meta_info(doc, strip=strip)


class OpenAISurface:
    """The OpenAI routes: the worker's events and answers relayed byte for byte, less what the
    gateway itself asked for (the forced usage chunk, ``meta_info``)."""

    shape: ErrorShape = OPENAI

    def __init__(self, overhead: int) -> None:
        # Data events per choice that carry no verify step: chat streams send a role chunk first
        # and a finish chunk last; text completions carry the finish on the last step's chunk.
        self._overhead = overhead

    def observer(self, request: ParsedRequest, *, expose: bool) -> SSEObserver:
        return SSEObserver(
            drop_usage=not request.client_wants_usage,
            overhead=self._overhead * request.choices,
            expose=expose,
        )

    @staticmethod
    def answer(body: bytes, request: ParsedRequest, rid: str | None) -> Answer:
        strip = not request.client_wants_meta_info
        read = read_answer(body, strip=strip, rid=rid)
        if read is not None:
            return read
        # Another shape than SGLang's: read as a document, re-serialised only when cut.
        doc, usage, steps = read_document(body, strip=strip, rid=rid)
        if strip and b'"meta_info"' in body:
            body = orjson.dumps(doc)
        return usage, steps, body


CHAT = OpenAISurface(overhead=2)
COMPLETIONS = OpenAISurface(overhead=0)


class TranslatedSurface:
    """Base of a surface whose client gets another document than the worker's chat answer."""

    def whole(self, doc: dict[str, Any], request: ParsedRequest) -> bytes:
        """The client's body for a worker's non-streamed JSON answer ``doc``."""
        raise NotImplementedError

    def answer(self, body: bytes, request: ParsedRequest, rid: str | None) -> Answer:
        doc, usage, steps = read_document(body, strip=not request.client_wants_meta_info, rid=rid)
        return usage, steps, self.whole(doc, request)
