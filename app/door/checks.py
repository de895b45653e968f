"""The door's built-in checks, each a small object built once at start-up: ``MediaType`` (a
``Check``, before the body is read), ``Accepting`` and ``Model`` (``RequestCheck``s, once it is
parsed); and what the door's stages call: ``read_body``, ``check_media_type``, ``check_model``
(also called by a surface that reads the model before translating the body). Where each runs is
``app.door.entrance``; the shape of a check and of a lease is ``app.door.visit``.

Each refuses with the error a client of the surface expects: 415 the body's media type (unless
``application/json`` without a Content-Encoding: a browser's form or ``text/plain`` POST cannot
reach a worker), 413 the body past the cap (499 when the client leaves while sending it), 503
while the gateway drains, 404 the model (503 while no worker serves it).
"""

from __future__ import annotations

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
from app.proxy.downstream import Receive
from app.proxy.request import ParsedRequest


class MediaType:
    """JSON (any parameters, e.g. charset), not encoded; else 415."""

    def check(self, visit: Visit) -> None:
        read = visit.read
        check_media_type(read.get(b"content-type"), read.get(b"content-encoding"))


class Accepting:
    """503 once the drain window closed (``Gateway.accepting``)."""

    def __init__(self, gw: Gateway) -> None:
        self._gw = gw

    def check(self, visit: Visit, request: ParsedRequest) -> None:
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

    def check(self, visit: Visit, request: ParsedRequest) -> None:
        check_model(self._gw, request.model, request.served_model, visit.entry.model_hint)


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


async def read_body(receive: Receive, declared: bytes | None, limit: int) -> bytes:
    """The request body, refused (413) as soon as it is known to exceed ``limit`` bytes
    (``declared``: its Content-Length, if any); 499 when the client leaves while sending it."""
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
