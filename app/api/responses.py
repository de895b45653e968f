"""``GET``/``DELETE /v1/responses/{response_id}`` (``POST /v1/responses`` is a row of the surface
registry, ``app.surfaces``, declared with the others by ``app.api.surfaces``): they read the
response store (``app.response_store``) under the caller's key: 404 for a response that is not
stored, stored under another key, expired, or when no store is configured."""

from __future__ import annotations

from typing import Any

import orjson
from fastapi import APIRouter
from starlette.responses import Response

from app.api.deps import GatewayDep
from app.api.security import ClientKey
from app.errors import NotFound
from app.openai.schema import error_responses

router = APIRouter()

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
