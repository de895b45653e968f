"""The Messages routes as FastAPI sees them: declared for ``/openapi.json``, 405s and the CORS
case; ``app.main.GatewayApp`` serves their POSTs itself (``app.anthropic.serve``)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import Response

from app.anthropic import serve as lane
from app.api.deps import GatewayDep
from app.gateway import Gateway
from app.proxy.downstream import Receive, Send

router = APIRouter()

_BODY = {
    "requestBody": {
        "required": True,
        "content": {"application/json": {"schema": {"type": "object"}}},
    }
}
_ANSWER: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "a Message, or its events when stream is true (Anthropic's shapes)",
        "content": {
            "application/json": {"schema": {"type": "object"}},
            "text/event-stream": {"schema": {}},
        },
    }
}


class MessagesResponse(Response):
    """A Messages request routed by FastAPI, answered by ``app.anthropic.serve.serve``."""

    def __init__(self, gw: Gateway, path: str) -> None:
        super().__init__()  # status and headers are decided by serve
        self._gw = gw
        self._path = path

    async def __call__(self, scope: Any, receive: Receive, send: Send) -> None:
        await lane.serve(self._gw, self._path, scope, receive, send)


def _declare(path: str, name: str) -> None:
    async def endpoint(request: Request, gw: GatewayDep) -> Response:
        return MessagesResponse(gw, path)

    endpoint.__name__ = name
    router.add_api_route(
        path,
        endpoint,
        methods=["POST"],
        openapi_extra=_BODY,
        responses=_ANSWER,
        response_class=Response,
    )


_declare(lane.MESSAGES_ROUTE, "messages")
_declare(lane.COUNT_ROUTE, "count_tokens")
