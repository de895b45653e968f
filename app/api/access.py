"""Every answer leaves a trace: one access-log line, and the API's answers count in
``requests_total``.

The proxy records the requests it runs (``app.proxy.forward``); this module records the rest:

- ``reject``: a completion or Messages request refused before the proxy ran
  (400/401/404/413/415/429/503);
- ``refusals(gw)``: requests the server's protocol answered itself (408, 431, 400 for unparsable
  HTTP, 503 over ``limits.max_connections``; ``app.server.guard``);
- ``AccessMiddleware``: everything FastAPI answers (``/v1/models``, probes, ``/metrics``, 404s...).

``requests_total{route}`` counts the API: the two completion routes, ``/v1/models`` and refusals
at the protocol layer (route ``other`` when the path is not one of those, e.g. a 431 whose request
line never ended). Probes, scrapes and unknown paths are in the access log only, so the metric's
label set stays bounded and its error ratio is about API traffic. The access line's ``route`` is
one of a fixed set of paths, else ``other``: a client's path never reaches a log line.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from app.accesslog import AccessRecord
from app.api.request_id import request_id_of
from app.errors import GatewayError
from app.gateway import Gateway
from app.metrics import OTHER
from app.outcomes import Outcome
from app.proxy.downstream import Message, Receive, Send

# The routes served in plain ASGI ahead of FastAPI, which record their own answers.
COMPLETION_ROUTES = frozenset(
    {
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/messages",
        "/v1/messages/count_tokens",
        "/v1/responses",
    }
)
API_ROUTES = COMPLETION_ROUTES | {"/v1/models"}
OPS_ROUTES = frozenset({"/livez", "/readyz", "/health", "/metrics", "/workers", "/openapi.json"})
KNOWN_ROUTES = API_ROUTES | OPS_ROUTES
NO_MODEL = "-"
REJECTED = Outcome.REJECTED


def route_label(path: str) -> str:
    return path if path in KNOWN_ROUTES else OTHER


def reject(
    gw: Gateway,
    route: str,
    request_id: str,
    error: GatewayError,
    *,
    key: str | None = None,
    duration_s: float | None = None,
) -> None:
    """Record a request answered with ``error`` before any worker was asked (its model is not
    named: it may be any string a client sent)."""
    gw.metrics.record_request(route, OTHER, error.status)
    record = AccessRecord(
        request_id, route, NO_MODEL, False, key=key, status=error.status, outcome=REJECTED
    )
    record.error = error.message
    if duration_s is not None:
        record.duration_ms = round(duration_s * 1000, 3)
    gw.access.emit(record)


def refusals(gw: Gateway) -> Callable[[bytes, str, GatewayError], None]:
    """The server protocol's ``Report`` (``app.server.guard``) for this gateway."""

    def report(target: bytes, request_id: str, error: GatewayError) -> None:
        path = target.split(b"?", 1)[0]
        route = path.decode("latin-1") if path in _API_TARGETS else OTHER
        reject(gw, route, request_id, error)

    return report


_API_TARGETS = frozenset(route.encode("ascii") for route in API_ROUTES)


class AccessMiddleware:
    """One access line per answer FastAPI gives (completion POSTs record themselves)."""

    def __init__(self, app: Any, gateway: Gateway) -> None:
        self.app = app
        self.gateway = gateway

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        path = scope.get("path", "") if scope["type"] == "http" else ""
        if not path or (scope["method"] == "POST" and path in COMPLETION_ROUTES):
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
            route = route_label(path)
            end = gw.proxy.now()
            record = AccessRecord(request_id_of(scope), route, NO_MODEL, False, status=status)
            record.duration_ms = round((end - started) * 1000, 3)
            if 400 <= status < 500:
                record.outcome = REJECTED
            if route in API_ROUTES:
                gw.metrics.record_request(route, OTHER, status, end - started)
            gw.access.emit(record)
