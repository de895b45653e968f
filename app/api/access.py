"""Every answer leaves a trace: one access-log line, and the API's answers count in
``requests_total``.

The proxy records the requests it runs (``app.proxy.forward``); this module records the rest:

- ``reject``: a completion or Messages request refused before the proxy ran
  (400/401/404/413/415/429/503);
- ``refusals(gw)``: requests the server's protocol answered itself (408, 431, 400 for unparsable
  HTTP, 503 over ``limits.max_connections``; ``app.server.guard``);
- ``AccessMiddleware``: everything FastAPI answers (``/v1/models``, probes, ``/metrics``, 404s...).

``requests_total{route}`` counts the API: the surface registry's POST routes (``app.surfaces``,
passed in as ``routes``), ``/v1/models`` and refusals at the protocol layer (route ``other`` when
the path is not one of those, e.g. a 431 whose request line never ended). Probes, scrapes and
unknown paths are in the access log only, so the metric's label set stays bounded and its error
ratio is about API traffic. The access line's ``route`` is one of a fixed set of paths, else
``other``; an ``other`` line also names the request's ``method`` and ``path`` (``client_text``:
control characters, quotes, backslashes and spaces escaped, at most 200 characters) so an operator
sees which endpoint a client wanted.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

from app.accesslog import AccessRecord
from app.api.request_id import request_id_of
from app.errors import GatewayError
from app.gateway import Gateway
from app.metrics import OTHER
from app.outcomes import Outcome
from app.proxy.downstream import Message, Receive, Send

MODELS_ROUTE = "/v1/models"
OPS_ROUTES = frozenset(
    {"/", "/api/hello", "/livez", "/readyz", "/health", "/metrics", "/workers", "/openapi.json"}
)
NO_MODEL = "-"
REJECTED = Outcome.REJECTED
MAX_CLIENT_TEXT = 200
# Bytes a log line shows escaped: C0 controls, space, quote, backslash, DEL, and every non-ASCII
# byte (a path is bytes on the wire; as UTF-8 it may hold C1 controls or bidi overrides).
_ESCAPED = {b: f"\\x{b:02x}" for b in (*range(0x21), 0x22, 0x5C, *range(0x7F, 0x100))}


def client_text(raw: bytes) -> str:
    """A client-chosen string (a method, a path) safe to write in a log line: printable ASCII,
    anything else escaped as ``\\xNN``, at most ``MAX_CLIENT_TEXT`` characters (``...`` marks
    the cut)."""
    text = "".join(_ESCAPED.get(b, chr(b)) for b in raw[: MAX_CLIENT_TEXT + 1])
    if len(text) > MAX_CLIENT_TEXT:
        return text[: MAX_CLIENT_TEXT - 3] + "..."
    return text


def reject(
    gw: Gateway,
    route: str,
    request_id: str,
    error: GatewayError,
    *,
    key: str | None = None,
    duration_s: float | None = None,
    path: str | None = None,
) -> None:
    """Record a request answered with ``error`` before any worker was asked (its model is not
    named: it may be any string a client sent). ``path``: the target's path (escaped) when
    ``route`` is ``other``."""
    gw.metrics.record_request(route, OTHER, error.status)
    record = AccessRecord(
        request_id, route, NO_MODEL, False, key=key, status=error.status, outcome=REJECTED
    )
    record.path = path
    record.error = error.message
    if duration_s is not None:
        record.duration_ms = round(duration_s * 1000, 3)
    gw.access.emit(record)


def refusals(gw: Gateway, routes: Collection[str]) -> Callable[[bytes, str, GatewayError], None]:
    """The server protocol's ``Report`` (``app.server.guard``) for this gateway, whose API POST
    routes are ``routes``."""
    api = frozenset(route.encode("ascii") for route in (*routes, MODELS_ROUTE))

    def report(target: bytes, request_id: str, error: GatewayError) -> None:
        path = target.split(b"?", 1)[0]
        if path in api:
            reject(gw, path.decode("latin-1"), request_id, error)
        else:
            reject(gw, OTHER, request_id, error, path=client_text(path) or None)

    return report


class AccessMiddleware:
    """One access line per answer FastAPI gives; the POSTs to ``routes`` (the surface registry's
    API routes) record themselves."""

    def __init__(self, app: Any, gateway: Gateway, routes: Collection[str]) -> None:
        self.app = app
        self.gateway = gateway
        self.routes = frozenset(routes)
        self.api = self.routes | {MODELS_ROUTE}
        self.known = self.api | OPS_ROUTES

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        path = scope.get("path", "") if scope["type"] == "http" else ""
        if not path or (scope["method"] == "POST" and path in self.routes):
            await self.app(scope, receive, send)
            return
        gw = self.gateway
        started = gw.proxy.now()
        status = 500

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            route = path if path in self.known else OTHER
            end = gw.proxy.now()
            record = AccessRecord(request_id_of(scope), route, NO_MODEL, False, status=status)
            if route == OTHER:
                record.method = client_text(scope["method"].encode("latin-1"))
                raw = scope.get("raw_path") or path.encode("utf-8")
                record.path = client_text(raw.split(b"?", 1)[0])
            record.duration_ms = round((end - started) * 1000, 3)
            if 400 <= status < 500:
                record.outcome = REJECTED
            if route in self.api:
                gw.metrics.record_request(route, OTHER, status, end - started)
            gw.access.emit(record)
