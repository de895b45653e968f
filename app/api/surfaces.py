"""Every API POST route of the surface registry (``app.surfaces``) as FastAPI sees it: declared
for ``/openapi.json`` (each ``Entry``'s ``operation``) and 405 for other methods. The POSTs
themselves never reach FastAPI: ``app.api.asgi.GatewayApp`` hands them to the door ahead of it,
CORS on or off; FastAPI's endpoint answers through the same door
(``app.door.entrance.Door.serve``) should FastAPI ever be called with one directly."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import Response

from app.door.entrance import Door
from app.door.entry import Entry
from app.proxy.downstream import Receive, Send


class DoorResponse(Response):
    """A request of the door that FastAPI routed: answered by the same code, as FastAPI's
    response."""

    def __init__(self, door: Door, entry: Entry) -> None:
        super().__init__()  # status and headers are decided by the door
        self._door = door
        self._entry = entry

    async def __call__(self, scope: Any, receive: Receive, send: Send) -> None:
        await self._door.serve(self._entry, scope, receive, send)


def router(door: Door, entries: Iterable[Entry]) -> APIRouter:
    """A router declaring each entry's POST route, served by ``door``."""
    routes = APIRouter()
    for entry in entries:
        _declare(routes, door, entry)
    return routes


def _declare(routes: APIRouter, door: Door, entry: Entry) -> None:
    async def endpoint(request: Request) -> Response:
        return DoorResponse(door, entry)

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
