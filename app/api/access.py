"""Every answer FastAPI gives leaves a trace: one access-log line, and the API's answers count
in ``requests_total``.

The proxy records the requests it runs (``app.proxy.forward``), the door those it refuses and
those the server's protocol answered itself (``app.door.reject``); ``AccessMiddleware`` records
everything FastAPI answers (``/v1/models``, probes, ``/metrics``, 404s...).

``requests_total{route}`` counts the API: the surface registry's POST routes (``app.surfaces``,
passed in as ``routes``), ``/v1/models`` and refusals at the protocol layer (route ``other`` when
the path is not one of those). Probes, scrapes and unknown paths are in the access log only, so
the metric's label set stays bounded and its error ratio is about API traffic. The access line's
``route`` is one of a fixed set of paths, else ``other``; an ``other`` line also names the
request's ``method`` and ``path`` (``client_text``) so an operator sees which endpoint a client
wanted.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from app.accesslog import AccessRecord
from app.door.reject import MODELS_ROUTE, NO_MODEL, OPS_ROUTES, REJECTED, client_text
from app.door.request_id import client_request_id_of, request_id_of
from app.gateway import Gateway
from app.metrics import OTHER
from app.proxy.downstream import Message, Receive, Send


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
            record.client_request_id = client_request_id_of(scope)
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
