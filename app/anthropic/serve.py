"""``POST /v1/messages`` and ``POST /v1/messages/count_tokens``, in plain ASGI like the OpenAI
routes (``app.proxy.ingress``), with Anthropic's conventions: the API key in ``x-api-key`` or
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

import contextlib
import logging
from typing import Any

import orjson

from app.accesslog import AccessRecord
from app.anthropic.request import COUNTED, load, translate
from app.anthropic.response import to_message
from app.anthropic.shape import ANTHROPIC
from app.anthropic.stream import MessagesStream
from app.api.access import reject
from app.api.request_id import outer_send, request_id_of
from app.api.security import admit, key_name, release
from app.errors import GatewayError, UpstreamBadResponse
from app.gateway import Gateway
from app.proxy.direct import direct_body
from app.proxy.downstream import Receive, Send, send_error
from app.proxy.forward import Job
from app.proxy.headers import client_headers
from app.proxy.ingress import check_media_type, check_model, read_body
from app.proxy.request import ParsedRequest, Route, parse_request
from app.proxy.surface import ErrorShape
from app.routing.keys import SESSION_HEADER, routing_key
from app.routing.policies import RoutingContext

log = logging.getLogger(__name__)

MESSAGES_ROUTE = "/v1/messages"
COUNT_ROUTE = "/v1/messages/count_tokens"
ROUTES = frozenset({MESSAGES_ROUTE, COUNT_ROUTE})
_SESSION = SESSION_HEADER.encode("ascii")
_READ = frozenset(
    {
        b"authorization",
        b"x-api-key",
        b"content-length",
        b"content-type",
        b"content-encoding",
        _SESSION,
    }
)


class MessagesSurface:
    """The Messages API over a chat request (``app.proxy.surface.Surface``)."""

    shape: ErrorShape = ANTHROPIC

    @staticmethod
    def observer(request: ParsedRequest, *, expose: bool) -> MessagesStream:
        return MessagesStream(request.model, expose=expose)

    @staticmethod
    def whole(doc: dict[str, Any], request: ParsedRequest) -> bytes:
        return orjson.dumps(to_message(doc, request.model))


class CountSurface(MessagesSurface):
    """count_tokens: the worker's ``{"input_tokens": N}``, checked."""

    @staticmethod
    def whole(doc: dict[str, Any], request: ParsedRequest) -> bytes:
        count = doc.get("input_tokens")
        if not isinstance(count, int) or isinstance(count, bool) or count < 0:
            raise UpstreamBadResponse("a worker answered count_tokens without input_tokens")
        return b'{"input_tokens":%d}' % count


MESSAGES = MessagesSurface()
COUNT = CountSurface()


def api_key(read: dict[bytes, bytes]) -> str | None:
    """The Authorization value the key check reads: ``x-api-key`` as a bearer token, else the
    request's own Authorization header."""
    key = read.get(b"x-api-key")
    if key is not None:
        return "Bearer " + key.decode("latin-1").strip()
    authorization = read.get(b"authorization")
    return authorization.decode("latin-1") if authorization is not None else None


def _parse(gw: Gateway, path: str, raw: bytes) -> ParsedRequest:
    limits, aliases = gw.settings.limits, gw.settings.model_aliases
    body = load(raw)
    count = path == COUNT_ROUTE
    translated = translate(body, max_messages=limits.max_messages, count_only=count)
    if translated.dropped is not None:
        log.debug("request field %r (maybe others) dropped", translated.dropped[:100])
        gw.metrics.record_dropped_fields(path)
    if not count:
        chat = orjson.dumps(translated.chat)
        return parse_request(chat, Route.CHAT, limits=limits, aliases=aliases, surface=MESSAGES)
    model = translated.chat["model"]
    served = aliases.get(model, model)
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


async def serve(gw: Gateway, path: str, scope: Any, receive: Receive, send: Send) -> None:
    """Answer one Messages or count_tokens request (see the module doc)."""
    started = gw.proxy.now()
    request_id = request_id_of(scope)
    key: str | None = None
    slot: contextlib.AsyncExitStack | None = None
    try:
        read, forwarded = client_headers(scope["headers"], _READ)
        key = key_name(api_key(read), gw)
        check_media_type(read.get(b"content-type"), read.get(b"content-encoding"))
        slot = await admit(gw, key)
        raw = await read_body(
            receive, read.get(b"content-length"), gw.settings.limits.max_body_bytes
        )
        parsed = _parse(gw, path, raw)
        check_model(gw, parsed)
    except Exception as exc:
        if slot is not None:
            await release(slot)
        lane = direct_body(scope)
        if lane is not None and lane.stopped():  # the server answered and recorded it
            return
        if not isinstance(exc, GatewayError):  # a bug: log it, never show it
            log.exception("request %s failed inside the gateway", request_id)
            exc = GatewayError("internal error")
        reject(gw, path, request_id, exc, key=key, duration_s=gw.proxy.now() - started)
        await send_error(send, exc, request_id.encode("ascii"), ANTHROPIC)
        return
    forwarded.append((b"x-request-id", request_id.encode("ascii")))
    session = read.get(_SESSION)
    ctx = RoutingContext(
        parsed.served_model,
        routing_key(parsed, session.decode("latin-1") if session else None),
    )
    record = AccessRecord(request_id, path, parsed.served_model, parsed.stream, key=key)
    job = Job(parsed, forwarded, request_id, ctx, record, started)
    try:
        await gw.proxy.run(job, receive, outer_send(scope, send), direct_body(scope))
    finally:
        if slot is not None:
            await release(slot)
        if key is not None and record.completion_tokens:
            gw.metrics.record_key_tokens(key, record.completion_tokens)
