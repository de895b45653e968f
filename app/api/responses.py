"""The Responses routes as FastAPI sees them: ``POST /v1/responses`` declared for
``/openapi.json``, 405s and the CORS case (``app.main.GatewayApp`` serves its POSTs itself:
``app.responses.serve``), and ``GET``/``DELETE /v1/responses/{response_id}``, which read the
response store (``app.responses.store``) under the caller's key: 404 for a response that is not
stored, stored under another key, expired, or when no store is configured."""

from __future__ import annotations

from typing import Any

import orjson
from fastapi import APIRouter, Request
from starlette.responses import Response

from app.api.deps import GatewayDep
from app.api.openai import LaneResponse
from app.api.schema import completion_responses, error_responses
from app.api.security import ClientKey
from app.errors import NotFound
from app.responses import serve as lane

router = APIRouter()

_BODY = {
    "requestBody": {
        "required": True,
        "content": {"application/json": {"schema": {"type": "object"}}},
    }
}


async def create_response(request: Request, gw: GatewayDep) -> Response:
    return LaneResponse(gw, lane.ENTRY)


router.add_api_route(
    lane.RESPONSES_ROUTE,
    create_response,
    methods=["POST"],
    openapi_extra=_BODY,
    responses=completion_responses(),
    response_class=Response,
)
_GONE: dict[int | str, dict[str, Any]] = {
    status: error_responses()[status] for status in (401, 404)
}


def _missing(response_id: str) -> NotFound:
    return NotFound(f"No response with id {response_id[:64]!r} found.", param="response_id")


@router.get("/v1/responses/{response_id}", responses=_GONE, response_class=Response)
async def retrieve_response(response_id: str, gw: GatewayDep, key: ClientKey) -> Response:
    store = gw.responses
    record = None if store is None else await store.get(key, response_id)
    if record is None or not isinstance(record.get("response"), dict):
        raise _missing(response_id)
    return Response(orjson.dumps(record["response"]), media_type="application/json")


@router.delete("/v1/responses/{response_id}", responses=_GONE)
async def delete_response(response_id: str, gw: GatewayDep, key: ClientKey) -> dict[str, Any]:
    store = gw.responses
    if store is None or not await store.delete(key, response_id):
        raise _missing(response_id)
    return {"id": response_id, "object": "response", "deleted": True}
