"""Every API POST route of the surface registry (``app.surfaces``) as FastAPI sees it: declared
for ``/openapi.json`` (each ``Entry``'s ``operation``), 405 for other methods, and served here in
the CORS case; otherwise ``app.main.GatewayApp`` serves those POSTs itself, ahead of FastAPI
(``app.proxy.ingress.serve_entry``), with the same code."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import Response

from app.api.deps import GatewayDep
from app.gateway import Gateway
from app.proxy.downstream import Receive, Send
from app.proxy.ingress import Entry, serve_entry


class LaneResponse(Response):
    """A request of the plain-ASGI lane (``app.proxy.ingress.serve_entry``) that FastAPI routed
    (the CORS case): answered by the same code, as FastAPI's response."""

    def __init__(self, gw: Gateway, entry: Entry) -> None:
        super().__init__()  # status and headers are decided by serve_entry
        self._gw = gw
        self._entry = entry

    async def __call__(self, scope: Any, receive: Receive, send: Send) -> None:
        await serve_entry(self._gw, self._entry, scope, receive, send)


def router(entries: Iterable[Entry]) -> APIRouter:
    """A router declaring each entry's POST route."""
    routes = APIRouter()
    for entry in entries:
        _declare(routes, entry)
    return routes


def _declare(routes: APIRouter, entry: Entry) -> None:
    async def endpoint(request: Request, gw: GatewayDep) -> Response:
        return LaneResponse(gw, entry)

    operation = entry.operation
    endpoint.__name__ = operation.name
    routes.add_api_route(
        entry.route,
        endpoint,
        methods=["POST"],
        openapi_extra=dict(operation.body),
        responses={status: dict(answer) for status, answer in operation.responses.items()},
        response_class=Response,
    )
