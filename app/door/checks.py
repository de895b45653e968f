"""The door's checks, each a small object built once at start-up (the order they run in is the
list in ``app.door.entrance``; the shape of a check and of a lease is ``app.door.visit``).

Each refuses with the error a client of the surface expects: 400 a repeated header, 401 the
key, 429 the key's quotas and limits (before the body is read; from there on every answer
carries the key's rate-limit headers), 415 the body's media type (unless ``application/json``
without a Content-Encoding: a browser's form or ``text/plain`` POST cannot reach a worker), 413
the body past the cap (499 when the client leaves while sending it; nothing when the server
answered the request itself, e.g. a 408 for a body too slow: it recorded that), 400 its
validation (``app.proxy.request``), 503 while the gateway drains, 404 the model (503 while no
worker serves it).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable

from app.door.api_keys import key_name
from app.door.request_id import echo_id_of, request_id_of
from app.door.visit import Visit
from app.errors import (
    InvalidRequest,
    ModelNotFound,
    PayloadTooLarge,
    ServiceUnavailable,
    UnsupportedMediaType,
)
from app.gateway import Gateway
from app.model_names import resolve, unknown_model
from app.proxy.headers import client_headers
from app.tenants.tenant import PRIORITY_HEADER

log = logging.getLogger(__name__)

_PRIORITY = PRIORITY_HEADER.lower().encode("ascii")


class RequestId:
    """The request's ids: the gateway's own (``request_id``) and the ``X-Request-Id`` echoed
    (``echo_id``: the client's if sane, else the gateway's)."""

    def check(self, visit: Visit) -> None:
        visit.request_id = request_id_of(visit.scope)
        visit.echo_id = echo_id_of(visit.scope)


class Trace:
    """The request's server span (tracing on), ended with the response or the refusal."""

    def __init__(self, gw: Gateway) -> None:
        assert gw.tracer is not None
        self._tracer = gw.tracer

    def check(self, visit: Visit) -> None:
        scope, route = visit.scope, visit.entry.route
        visit.trace = self._tracer.begin(scope["headers"], route, visit.request_id, visit.started)
        visit.hold(self)

    @staticmethod
    def release(visit: Visit) -> None:
        trace, job = visit.trace, visit.job
        if trace is None:
            return
        if job is not None:
            trace.finish(job.record, job.queue_wait_s)
        elif visit.error is not None:
            trace.refused(visit.error, visit.key)


class Headers:
    """The headers the entry reads (a repeated one is a 400) and those a worker gets."""

    def __init__(self, gw: Gateway) -> None:
        self._forward = gw.forward_headers

    def check(self, visit: Visit) -> None:
        visit.read, visit.forwarded = client_headers(
            visit.scope["headers"], visit.entry.read, self._forward
        )


class Key:
    """The caller's API key (where the entry says it is): 401 when missing or wrong. Only in
    the list when keys are configured."""

    def __init__(self, gw: Gateway) -> None:
        self._gw = gw

    def check(self, visit: Visit) -> None:
        entry = visit.entry
        read = visit.read
        visit.key = key_name(entry.credential(read), self._gw, entry.key_texts(read))


class Tenancy:
    """The key's policy and the request's priority class (``X-Priority``)."""

    def __init__(self, gw: Gateway) -> None:
        self._tenants = gw.tenants

    def check(self, visit: Visit) -> None:
        visit.tenant = self._tenants.resolve(visit.key, visit.read.get(_PRIORITY))


class MediaType:
    """JSON (any parameters, e.g. charset), not encoded; else 415."""

    def check(self, visit: Visit) -> None:
        read = visit.read
        check_media_type(read.get(b"content-type"), read.get(b"content-encoding"))


class Body:
    """The body, refused (413) as soon as it is known to exceed ``limits.max_body_bytes``
    (``read_body``)."""

    def __init__(self, gw: Gateway) -> None:
        self._limit = gw.settings.limits.max_body_bytes

    def check(self, visit: Visit) -> Awaitable[None]:
        return read_body(visit, visit.read.get(b"content-length"), self._limit)


class Parse:
    """The body as the entry reads it (translated for a translating surface; 400 naming the
    field); awaited for an entry that ``load``s (reads state to build it)."""

    def __init__(self, gw: Gateway) -> None:
        self._gw = gw

    def check(self, visit: Visit) -> Awaitable[None] | None:
        entry = visit.entry
        if entry.load is not None:
            return self._load(visit)
        visit.parsed = entry.parse(self._gw, visit.raw)
        return None

    async def _load(self, visit: Visit) -> None:
        assert visit.entry.load is not None
        visit.parsed = await visit.entry.load(self._gw, visit.raw, visit.key)


class Accepting:
    """503 once the drain window closed (``Gateway.accepting``)."""

    def __init__(self, gw: Gateway) -> None:
        self._gw = gw

    def check(self, visit: Visit) -> None:
        gw = self._gw
        if not gw.accepting:
            raise ServiceUnavailable(
                "the gateway is shutting down; retry on another replica",
                retry_after=gw.settings.admission.retry_after_s,
            )


class Model:
    """The request's model is served (or an alias of one): 404 otherwise, 503 while no healthy
    worker serves any."""

    def __init__(self, gw: Gateway) -> None:
        self._gw = gw

    def check(self, visit: Visit) -> None:
        parsed = visit.parsed
        assert parsed is not None
        check_model(self._gw, parsed.model, parsed.served_model, visit.entry.model_hint)


def check_model(gw: Gateway, model: str, served_model: str | None = None, hint: str = "") -> None:
    """``model`` (``served_model``: what it resolves to, when known) is served: else a 404 that
    names the names that would work (``app.model_names``), then ``hint``; 503 while no healthy
    worker serves any model."""
    served = gw.pool.served_models()
    aliases = gw.settings.model_aliases
    if (served_model or resolve(aliases, model)) in served:
        return
    if not served:
        raise ServiceUnavailable(
            "no healthy worker yet; try again shortly",
            retry_after=gw.settings.admission.retry_after_s,
        )
    raise ModelNotFound(unknown_model(model, served, aliases, hint), param="model")


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


async def read_body(visit: Visit, declared: bytes | None, limit: int) -> None:
    """The request body into ``visit.raw``, refusing (413) as soon as it is known to exceed
    ``limit`` bytes (``declared``: its Content-Length, if any)."""
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"request body is larger than {limit} bytes")
    receive = visit.receive
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
            visit.raw = parts[0] if len(parts) == 1 else b"".join(parts)
            return
