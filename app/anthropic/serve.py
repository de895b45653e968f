"""``POST /v1/messages`` and ``POST /v1/messages/count_tokens``, in plain ASGI like the OpenAI
routes (``app.openai.serve``), with Anthropic's conventions: the API key in ``x-api-key`` or
``Authorization: Bearer`` (either given twice is a 400), any ``anthropic-version``, and every
error in Anthropic's shape (``app.anthropic.shape``), those found before the proxy runs too.

A Messages request is checked and translated (``app.anthropic.request``), then parsed as the
chat request it became (``app.proxy.request``: the body cap, ``max_messages``, the
``max_tokens`` cap, the routing key) and run by the proxy like any chat request, with
``MESSAGES`` as its surface. ``count_tokens`` goes to a worker's own
``/v1/messages/count_tokens`` (SGLang serves it: the model's chat template and tokenizer count
the prompt), through the same proxy.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import orjson

from app.anthropic.openapi import operation
from app.anthropic.request import COUNTED, load, translate
from app.anthropic.response import to_message
from app.anthropic.shape import ANTHROPIC
from app.anthropic.stream import MessagesStream
from app.door.api_keys import anthropic_key_texts
from app.door.checks import check_model
from app.door.entry import ParsingEntry
from app.errors import UpstreamBadResponse
from app.gateway import Gateway
from app.media_policy import image_policy
from app.model_names import resolve
from app.proxy.request import ParsedRequest, Route, parse_request
from app.proxy.surface import ErrorShape, TranslatedSurface
from app.routing.routing_key import SESSION_HEADER
from app.tenants.headers import anthropic_headers
from app.tenants.tenant import PRIORITY_HEADER

log = logging.getLogger(__name__)

# An unknown model's 404 on these routes ends with where Claude Code takes its model from.
MODEL_HINT = "Claude Code: set ANTHROPIC_MODEL to one of them (or the gateway's model_aliases)."
MESSAGES_ROUTE = "/v1/messages"
COUNT_ROUTE = "/v1/messages/count_tokens"
_SESSION = SESSION_HEADER.encode("ascii")
_READ = frozenset(
    {
        b"authorization",
        b"x-api-key",
        b"content-length",
        b"content-type",
        b"content-encoding",
        _SESSION,
        PRIORITY_HEADER.lower().encode("ascii"),
    }
)


class MessagesSurface(TranslatedSurface):
    """The Messages API over a chat request (``app.proxy.surface.Surface``); ``omit_thinking``:
    for the requests that asked for empty thinking blocks (``thinking.display: "omitted"``)."""

    shape: ErrorShape = ANTHROPIC

    def __init__(self, *, omit_thinking: bool = False) -> None:
        self.omit_thinking = omit_thinking

    def observer(self, request: ParsedRequest, *, expose: bool) -> MessagesStream:
        return MessagesStream(request.model, expose=expose, omit_thinking=self.omit_thinking)

    def whole(self, doc: dict[str, Any], request: ParsedRequest) -> bytes:
        return orjson.dumps(to_message(doc, request.model, omit_thinking=self.omit_thinking))


class CountSurface(MessagesSurface):
    """count_tokens: the worker's ``{"input_tokens": N}``, checked."""

    def whole(self, doc: dict[str, Any], request: ParsedRequest) -> bytes:
        count = doc.get("input_tokens")
        if not isinstance(count, int) or isinstance(count, bool) or count < 0:
            raise UpstreamBadResponse("a worker answered count_tokens without input_tokens")
        return b'{"input_tokens":%d}' % count


MESSAGES = MessagesSurface()
MESSAGES_NO_THINKING_TEXT = MessagesSurface(omit_thinking=True)
COUNT = CountSurface()


def api_key(read: dict[bytes, bytes]) -> str | None:
    """The Authorization value the key check reads: ``x-api-key`` as a bearer token, else the
    request's own Authorization header."""
    key = read.get(b"x-api-key")
    if key is not None:
        return "Bearer " + key.decode("latin-1").strip()
    authorization = read.get(b"authorization")
    return authorization.decode("latin-1") if authorization is not None else None


def _parse(gw: Gateway, raw: bytes, *, path: str) -> ParsedRequest:
    limits, aliases = gw.settings.limits, gw.settings.model_aliases
    body = load(raw)
    model = body.get("model")
    if isinstance(model, str) and model:  # before the body: a 404 says what to set
        check_model(gw, model, hint=MODEL_HINT)
    count = path == COUNT_ROUTE
    images = image_policy(limits.image_url_allow, limits.image_url_cluster_suffixes)
    translated = translate(body, max_messages=limits.max_messages, count_only=count, images=images)
    if translated.dropped is not None:
        log.debug("request field %r (maybe others) dropped", translated.dropped[:100])
        gw.metrics.record_dropped_fields(path)
    if not count:
        chat = orjson.dumps(translated.chat)
        surface = MESSAGES_NO_THINKING_TEXT if translated.omit_thinking else MESSAGES
        return parse_request(chat, Route.CHAT, limits=limits, aliases=aliases, surface=surface)
    model = translated.chat["model"]
    served = resolve(aliases, model)
    fields = {name: body[name] for name in COUNTED if name in body}
    fields["model"] = served
    head = orjson.dumps(fields)[:-1] + b","
    return ParsedRequest(
        route=Route.COUNT_TOKENS,
        model=model,
        served_model=served,
        stream=False,
        client_wants_usage=False,
        client_wants_meta_info=True,  # nothing of the worker's answer to strip
        choices=1,
        user=None,
        conversation=(),
        dropped=None,
        _head=(head,),
        surface=COUNT,
    )


def _entry(path: str, surface: MessagesSurface, name: str) -> ParsingEntry:
    return ParsingEntry(
        path,
        _READ,
        api_key,
        anthropic_headers,
        operation(name),
        parse=functools.partial(_parse, path=path),
        surface=surface,
        key_texts=anthropic_key_texts,
        model_hint=MODEL_HINT,
    )


# The Messages surfaces, by path: ``app.surfaces`` lists them.
ENTRIES = {
    MESSAGES_ROUTE: _entry(MESSAGES_ROUTE, MESSAGES, "messages"),
    COUNT_ROUTE: _entry(COUNT_ROUTE, COUNT, "count_tokens"),
}
