"""The door of every API POST route (``Entry``), in plain ASGI; and the OpenAI routes' entries,
``POST /v1/chat/completions`` and ``POST /v1/completions``.

``serve_entry(gw, entry, scope, receive, send)`` is the whole request: its
X-Request-Id, the headers it reads (400 when one is repeated), the API key (401), the key's token
quotas and limits (429, before the body is read; from here on every answer carries the key's
rate-limit headers), the body's media type (415 unless ``application/json`` without a
Content-Encoding: a browser's form or ``text/plain`` POST cannot reach a worker), the body (413 past
the cap; 499 when the client leaves while sending it; nothing when the server answered the request
itself, e.g. a 408 for a body too slow: it recorded that), its validation (``app.proxy.request``,
400), the model (404; 503 while no worker serves it or the gateway drains), then the proxy, which
answers. Every error before the proxy runs is answered here in the surface's shape, logged and
counted (``app.api.access.reject``). Once the answer ended, its prompt + completion tokens are
charged to the key's token quotas. Each API family comes through the same door with an ``Entry``
of its own: its headers, key, body translation, surface and OpenAPI declaration
(``app.anthropic.serve``; the table of them all is ``app.surfaces``).

``GatewayApp`` (``app.main``) calls ``serve_entry`` ahead of FastAPI's middleware, routing and
dependency injection, which together cost about as much CPU per request as relaying the whole
answer. FastAPI still declares every entry's route (``app.api.surfaces``): they document the
bodies in ``/openapi.json``, answer other methods with 405, and serve the requests themselves when
CORS is configured (``CORSMiddleware`` must see those), through the same ``serve_entry``.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from app.accesslog import AccessRecord
from app.api.access import reject
from app.api.request_id import outer_send, request_id_of
from app.api.schema import (
    ChatCompletionRequest,
    CompletionRequest,
    completion_responses,
    request_body,
)
from app.api.security import admit, key_name, release
from app.errors import (
    GatewayError,
    InvalidRequest,
    ModelNotFound,
    PayloadTooLarge,
    ServiceUnavailable,
    UnsupportedMediaType,
)
from app.gateway import Gateway
from app.proxy.direct import direct_body
from app.proxy.downstream import Receive, Send, send_error
from app.proxy.forward import Job
from app.proxy.headers import client_headers
from app.proxy.request import ParsedRequest, Route, parse_request
from app.proxy.surface import CHAT, COMPLETIONS, Surface
from app.proxy.unreported import unreported_tokens
from app.routing.keys import SESSION_HEADER, routing_key
from app.routing.policies import RoutingContext
from app.tenants.headers import HeaderStyle, openai_headers
from app.tenants.tenant import PRIORITY_HEADER

log = logging.getLogger(__name__)

_SESSION = SESSION_HEADER.encode("ascii")
_PRIORITY = PRIORITY_HEADER.lower().encode("ascii")
_READ = frozenset(
    {
        b"authorization",
        b"content-length",
        b"content-type",
        b"content-encoding",
        _SESSION,
        _PRIORITY,
    }
)


@dataclass(frozen=True, slots=True)
class Operation:
    """How ``/openapi.json`` declares a POST route: its operation id, its body (the extra
    OpenAPI of the operation: ``request_body(Model)`` for a documented model) and its answers by
    status. ``models``: the pydantic models the body refers to (added to the components)."""

    name: str
    body: Mapping[str, Any]
    responses: Mapping[int | str, Mapping[str, Any]]
    models: tuple[type[BaseModel], ...] = ()


@dataclass(frozen=True, slots=True)
class Entry:
    """One POST route of an API surface, as the door serves it (a row of ``app.surfaces``): its
    path (also its ``route`` label in metrics and the access log), the headers read, where the
    API key is, how the body becomes a ``ParsedRequest`` (translated, with ``surface`` as its
    surface), the surface (stream observer, whole answer, error shape), the rate-limit headers'
    names and its OpenAPI declaration."""

    route: str
    read: frozenset[bytes]
    credential: Callable[[dict[bytes, bytes]], str | None]
    parse: Callable[[Gateway, bytes], ParsedRequest]
    surface: Surface
    limit_headers: HeaderStyle
    operation: Operation
    # Instead of ``parse``, for a surface that reads state to build the body (a stored
    # conversation): awaited with the caller's key name.
    load: Callable[[Gateway, bytes, str | None], Awaitable[ParsedRequest]] | None = None


def bearer(read: dict[bytes, bytes]) -> str | None:
    """The Authorization header (OpenAI's one place for the key)."""
    authorization = read.get(b"authorization")
    return authorization.decode("latin-1") if authorization is not None else None


def _openai(route: Route, surface: Surface, name: str, body: type[BaseModel]) -> Entry:
    def parse(gw: Gateway, raw: bytes) -> ParsedRequest:
        limits, aliases = gw.settings.limits, gw.settings.model_aliases
        return parse_request(raw, route, limits=limits, aliases=aliases, surface=surface)

    operation = Operation(name, request_body(body), completion_responses(), (body,))
    return Entry(route.value, _READ, bearer, parse, surface, openai_headers, operation)


# The OpenAI surfaces, by route: ``app.surfaces`` lists them.
ENTRIES = {
    Route.CHAT: _openai(Route.CHAT, CHAT, "chat_completions", ChatCompletionRequest),
    Route.COMPLETIONS: _openai(Route.COMPLETIONS, COMPLETIONS, "completions", CompletionRequest),
}


async def serve_entry(gw: Gateway, entry: Entry, scope: Any, receive: Receive, send: Send) -> None:
    """Answer one request of ``entry``'s API (see the module doc)."""
    started = gw.proxy.now()
    request_id = request_id_of(scope)
    tracer = gw.tracer
    trace = (
        None if tracer is None else tracer.begin(scope["headers"], entry.route, request_id, started)
    )
    key: str | None = None
    slot: contextlib.AsyncExitStack | None = None
    limit_headers: list[tuple[bytes, bytes]] = []  # on every answer from admission on
    try:
        read, forwarded = client_headers(scope["headers"], entry.read, gw.forward_headers)
        key = key_name(entry.credential(read), gw)
        tenant = gw.tenants.resolve(key, read.get(_PRIORITY))
        # Per-key quotas and limits: 429 before the body is even read.
        slot = await admit(gw, key, tenant.policy, entry.limit_headers, limit_headers)
        check_media_type(read.get(b"content-type"), read.get(b"content-encoding"))
        raw = await read_body(
            receive, read.get(b"content-length"), gw.settings.limits.max_body_bytes
        )
        parsed = entry.parse(gw, raw) if entry.load is None else await entry.load(gw, raw, key)
        check_model(gw, parsed)
    except Exception as exc:
        if trace is not None:
            trace.refused(exc, key)
        if slot is not None:
            await release(slot)
        lane = direct_body(scope)
        if lane is not None and lane.stopped():  # the server answered and recorded it
            return
        if not isinstance(exc, GatewayError):  # a bug: log it, never show it
            log.exception("request %s failed inside the gateway", request_id)
            exc = GatewayError("internal error")
        reject(gw, entry.route, request_id, exc, key=key, duration_s=gw.proxy.now() - started)
        await send_error(send, exc, request_id.encode("ascii"), entry.surface.shape, limit_headers)
        return
    forwarded.append((b"x-request-id", request_id.encode("ascii")))
    session = read.get(_SESSION)
    ctx = RoutingContext(
        parsed.served_model,
        routing_key(parsed, session.decode("latin-1") if session else None),
    )
    if parsed.dropped is not None:
        gw.metrics.record_dropped_fields(entry.route)
    record = AccessRecord(
        request_id,
        entry.route,
        parsed.served_model,
        parsed.stream,
        key=key,
        priority=tenant.priority_name,
    )
    job = Job(
        parsed, forwarded, request_id, ctx, record, started, tenant, limit_headers, trace=trace
    )
    try:
        # The server's own send when RequestIdMiddleware ran (the CORS case): no wrapper per chunk.
        await gw.proxy.run(job, receive, outer_send(scope, send), direct_body(scope))
    finally:
        if trace is not None:
            trace.finish(record, job.queue_wait_s)
        if slot is not None:
            await release(slot)
        if key is not None and (record.prompt_tokens or record.completion_tokens):
            gw.metrics.record_key_tokens(
                key,
                prompt=record.prompt_tokens or 0,
                completion=record.completion_tokens or 0,
                reasoning=record.reasoning_tokens or 0,
            )
        if key is not None and gw.quota is not None:
            spent = (record.prompt_tokens or 0) + (record.completion_tokens or 0)
            await gw.quota.charge(key, tenant.policy, spent or unreported_tokens(job))


def check_media_type(content_type: bytes | None, encoding: bytes | None) -> None:
    """JSON (any parameters, e.g. charset), not encoded; else ``UnsupportedMediaType`` (415)."""
    if encoding is not None and encoding.strip().lower() not in (b"", b"identity"):
        raise UnsupportedMediaType(
            "Content-Encoding is not supported: send the body unencoded",
            param="content-encoding",
        )
    media = content_type.split(b";", 1)[0].strip().lower() if content_type else b""
    if media != b"application/json":
        raise UnsupportedMediaType(
            "the request body must be JSON, sent with Content-Type: application/json",
            param="content-type",
        )


async def read_body(receive: Receive, declared: bytes | None, limit: int) -> bytes:
    """The request body, refusing (413) as soon as it is known to exceed ``limit`` bytes
    (``declared``: its Content-Length, if any)."""
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"request body is larger than {limit} bytes")
    parts: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            # Gone, or cut off by the server's body deadline (app.server.guard).
            raise InvalidRequest(
                "the client closed the connection", status=499, code="client_closed_request"
            )
        part = message.get("body", b"")
        if part:
            size += len(part)
            if size > limit:
                raise PayloadTooLarge(f"request body is larger than {limit} bytes")
            parts.append(part)
        if not message.get("more_body", False):
            return parts[0] if len(parts) == 1 else b"".join(parts)


def check_model(gw: Gateway, parsed: ParsedRequest) -> None:
    if not gw.accepting:
        raise ServiceUnavailable(
            "the gateway is shutting down; retry on another replica",
            retry_after=gw.settings.admission.retry_after_s,
        )
    served = gw.pool.served_models()
    if parsed.served_model in served:
        return
    if not served:
        raise ServiceUnavailable(
            "no healthy worker yet; try again shortly",
            retry_after=gw.settings.admission.retry_after_s,
        )
    raise ModelNotFound(f"The model `{parsed.model}` does not exist.", param="model")
