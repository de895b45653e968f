"""The Messages routes as FastAPI sees them: declared for ``/openapi.json``, 405s and the CORS
case; ``app.main.GatewayApp`` serves their POSTs itself (``app.anthropic.serve``)."""

from __future__ import annotations

from typing import Any, Literal

from fastapi import APIRouter, Request
from pydantic import BaseModel
from starlette.responses import Response

from app.anthropic import serve as lane
from app.api.deps import GatewayDep
from app.api.openai import LaneResponse

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


class AnthropicErrorDetail(BaseModel):
    type: str
    message: str


class AnthropicError(BaseModel):
    type: Literal["error"]
    error: AnthropicErrorDetail


_WHY = {
    400: "invalid request (invalid_request_error)",
    401: "missing, wrong or revoked API key (authentication_error)",
    404: "unknown model (not_found_error)",
    408: "the request was sent too slowly",
    413: "body too large (request_too_large)",
    415: "the body is not JSON (Content-Type must be application/json) or is encoded",
    429: "per-key rate or concurrency limit (rate_limit_error; see Retry-After)",
    500: "internal error (api_error)",
    502: "a worker failed (api_error)",
    503: "no worker can take the request now (overloaded_error; see Retry-After)",
    504: "a worker did not answer in time (timeout_error)",
}
_ANSWER.update(
    {status: {"model": AnthropicError, "description": why} for status, why in _WHY.items()}
)


def _declare(path: str, name: str) -> None:
    async def endpoint(request: Request, gw: GatewayDep) -> Response:
        return LaneResponse(gw, lane.ENTRIES[path])

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
