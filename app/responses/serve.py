"""``POST /v1/responses``, a row of the surface registry (``app.surfaces``), with the
Responses API's conventions: the key in ``Authorization: Bearer``, errors before the stream began
in OpenAI's error shape, after it as ``response.failed`` (``ResponsesShape``), ``: keep-alive``
comments while the worker is silent (every SSE client skips comments).

A request is read (``app.responses.request.load``), its ``previous_response_id`` looked up in
the store under the caller's key (``app.response_store``), translated, then parsed as the chat
request it became (``app.proxy.request``: the body cap, ``max_messages``, the ``max_tokens``
cap, the routing key) and run by the proxy like any chat request, with a ``ResponsesSurface``
made for it: unlike the Messages surface it carries the request's state (the response id, the
settings the Response repeats, the flattened tool names, where to store the answer), so its
stream translator and its error shape are the request's own.
"""

from __future__ import annotations

import logging
from typing import Any

import orjson

from app.door.checks import check_model
from app.door.entry import LoadingEntry, Operation, bearer
from app.errors import GatewayError, InvalidRequest
from app.gateway import Gateway
from app.openai.schema import completion_responses
from app.openai.serve import READ
from app.proxy.request import ParsedRequest, Route, parse_request
from app.proxy.surface import OPENAI, ErrorShape, TranslatedSurface
from app.response_store.backends import ResponseStore, fetch
from app.responses.references import has_references, request_items, resolve
from app.responses.request import load, translate
from app.responses.response import Context, assistant_turn, to_response
from app.responses.stream import ResponsesStream
from app.tenants.headers import openai_headers

log = logging.getLogger(__name__)

RESPONSES_ROUTE = "/v1/responses"
# An unknown model's 404 here ends with where Codex CLI takes its model from.
MODEL_HINT = "Codex CLI: set model to one of them in its config.toml."


class ResponsesShape:
    """OpenAI's whole errors; one request's ``response.failed`` once its stream began."""

    keepalive = b": keep-alive\n\n"

    def __init__(self, ctx: Context) -> None:
        self._ctx = ctx

    @staticmethod
    def error_json(error: GatewayError) -> bytes:
        return OPENAI.error_json(error)

    def error_events(self, error: GatewayError) -> bytes:
        stream = self._ctx.current
        if stream is None:  # only keep-alives went out: the client has seen no event yet
            stream = ResponsesStream(self._ctx)
        events: bytes = stream.fail(error)
        return events


class ResponsesSurface(TranslatedSurface):
    """The Responses API over a chat request (``app.proxy.surface.Surface``), one per request."""

    __slots__ = ("ctx", "shape")
    shape: ErrorShape

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.shape = ResponsesShape(ctx)

    def observer(self, request: ParsedRequest, *, expose: bool) -> ResponsesStream:
        return ResponsesStream(self.ctx, expose=expose)

    def whole(self, doc: dict[str, Any], request: ParsedRequest) -> bytes:
        response = to_response(doc, self.ctx)
        if self.ctx.on_final is not None:
            self.ctx.on_final(response)
        return orjson.dumps(response)


def _saver(
    store: ResponseStore,
    key: str | None,
    ctx: Context,
    conversation: list[dict[str, Any]],
    items: list[dict[str, Any]] | None,
) -> Any:
    def save(response: dict[str, Any]) -> None:
        turn = assistant_turn(response, ctx)
        messages = [*conversation, turn] if turn is not None else conversation
        # Serialised once: the record embeds these bytes and keeps their size, which bounds a
        # later request continuing from it before that request is built (``_check_expanded``).
        data = orjson.dumps(messages)
        record = {"response": response, "messages": orjson.Fragment(data), "size": len(data)}
        if items is not None:  # what GET .../input_items lists, and item_reference resolves
            record["input"] = items
        store.save(key, ctx.id, record)

    return save


def _stored_size(record: dict[str, Any]) -> int:
    """The JSON size of a stored record's messages (kept with it; measured for a record saved
    without it)."""
    size = record.get("size")
    if isinstance(size, int) and not isinstance(size, bool) and size >= 0:
        return size
    return len(orjson.dumps(record["messages"]))


def _too_large(limit: int, stored: int, sent: int) -> InvalidRequest:
    return InvalidRequest(
        f"previous_response_id: the stored conversation ({stored} bytes) and this request "
        f"({sent} bytes) come to more than limits.max_body_bytes ({limit} bytes), the most one "
        "request may send to a worker; start a new conversation with less input",
        param="previous_response_id",
        code="request_too_large",
    )


async def _load(gw: Gateway, raw: bytes, key: str | None) -> ParsedRequest:
    limits, aliases = gw.settings.limits, gw.settings.model_aliases
    body = load(raw)
    model = body.get("model")
    if isinstance(model, str) and model:  # before the input, as the other surfaces do
        check_model(gw, model, hint=MODEL_HINT)
    store = gw.responses
    history = record = None
    stored = 0  # the JSON size of the stored conversation continued
    previous = body.get("previous_response_id")
    if isinstance(previous, str) and previous:
        if store is None:
            raise InvalidRequest(
                "previous_response_id: this gateway keeps no responses (responses.store is "
                "none); send the whole conversation as input",
                param="previous_response_id",
            )
        record = await fetch(store, key, previous)
        if record is None or not isinstance(record.get("messages"), list):
            raise InvalidRequest(
                f"previous_response_id: no stored response {previous[:64]!r}",
                param="previous_response_id",
                code="previous_response_not_found",
            )
        history = record["messages"]
        # Bounded before the expanded request is built: the stored messages' size plus this
        # body's (what the new turn adds is at most the body it came in).
        stored = _stored_size(record)
        if stored + len(raw) > limits.max_body_bytes:
            raise _too_large(limits.max_body_bytes, stored, len(raw))
    items = request_items(body.get("input"))
    if items is not None and has_references(items):
        items = resolve(items, record)
        body = {**body, "input": items}
    translated = translate(body, max_messages=limits.max_messages, history=history)
    if translated.dropped is not None:
        log.debug("request field %r (maybe others) dropped", translated.dropped[:100])
        gw.metrics.record_dropped_fields(RESPONSES_ROUTE)
    ctx = Context(
        translated.chat["model"],
        translated.echo,
        translated.names,
        translated.summary,
        custom=translated.custom,
    )
    if store is not None and translated.store:
        ctx.on_final = _saver(store, key, ctx, translated.conversation, items)
    try:
        chat = orjson.dumps(translated.chat)
    except orjson.JSONEncodeError:
        raise InvalidRequest("request body is nested too deeply") from None
    if history is not None and len(chat) > limits.max_body_bytes:  # the items' framing
        raise _too_large(limits.max_body_bytes, stored, len(raw))
    surface = ResponsesSurface(ctx)
    return parse_request(chat, Route.CHAT, limits=limits, aliases=aliases, surface=surface)


_BODY = {
    "requestBody": {
        "required": True,
        "content": {"application/json": {"schema": {"type": "object"}}},
    }
}
# Loaded, not parsed: the body may continue a stored conversation. Refused in OpenAI's shape
# until the request has a ``ResponsesSurface`` of its own (``_load``).
ENTRY = LoadingEntry(
    RESPONSES_ROUTE,
    READ,
    bearer,
    openai_headers,
    Operation("responses", _BODY, completion_responses()),
    load=_load,
    shape=OPENAI,
    model_hint=MODEL_HINT,
)
# The Responses surface, by path: ``app.surfaces`` lists it.
ENTRIES = {RESPONSES_ROUTE: ENTRY}
