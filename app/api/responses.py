"""``GET``/``DELETE /v1/responses/{response_id}`` and ``GET .../input_items`` (the stored request's
input items; ``POST /v1/responses`` is a row of the surface
registry, ``app.surfaces``, declared with the others by ``app.api.surfaces``): they read the
response store (``app.response_store``) under the caller's key: 404 for a response that is not
stored, stored under another key, expired, or when no store is configured."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import orjson
from fastapi import APIRouter, Query
from starlette.responses import Response

from app.api.deps import GatewayDep
from app.api.security import ClientKey
from app.errors import NotFound
from app.openai.schema import error_responses
from app.response_store.backends import fetch

router = APIRouter()

_GONE: dict[int | str, dict[str, Any]] = {
    status: error_responses()[status] for status in (401, 404)
}
# A list's query (limit, order) out of range is a 400, as every refused request is.
_LISTED: dict[int | str, dict[str, Any]] = {400: error_responses()[400], **_GONE}


def _missing(response_id: str) -> NotFound:
    return NotFound(f"No response with id {response_id[:64]!r} found.", param="response_id")


@router.get("/v1/responses/{response_id}", responses=_GONE, response_class=Response)
async def retrieve_response(response_id: str, gw: GatewayDep, key: ClientKey) -> Response:
    store = gw.responses
    record = None if store is None else await store.get(key, response_id)
    if record is None or not isinstance(record.get("response"), dict):
        raise _missing(response_id)
    return Response(orjson.dumps(record["response"]), media_type="application/json")


@router.get("/v1/responses/{response_id}/input_items", responses=_LISTED)
async def list_input_items(
    response_id: str,
    gw: GatewayDep,
    key: ClientKey,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    order: Literal["asc", "desc"] = "desc",
    after: str | None = None,
) -> dict[str, Any]:
    """The input items of a stored response (its request's ``input``, each with an id), newest
    first unless ``order=asc``; ``after``: the id the previous page ended with."""
    store = gw.responses
    # ``fetch``: a response just created may still be on its way to a shared store.
    record = None if store is None else await fetch(store, key, response_id)
    if record is None or not isinstance(record.get("response"), dict):
        raise _missing(response_id)
    stored = record.get("input")
    items = [item for item in stored if isinstance(item, dict)] if isinstance(stored, list) else []
    if order == "desc":
        items.reverse()
    if after is not None:
        ids = [item.get("id") for item in items]
        if after not in ids:
            raise NotFound(f"No input item with id {after[:64]!r} found.", param="after")
        items = items[ids.index(after) + 1 :]
    page = items[:limit]
    return {
        "object": "list",
        "data": page,
        "first_id": page[0].get("id") if page else None,
        "last_id": page[-1].get("id") if page else None,
        "has_more": len(items) > limit,
    }


@router.delete("/v1/responses/{response_id}", responses=_GONE)
async def delete_response(response_id: str, gw: GatewayDep, key: ClientKey) -> dict[str, Any]:
    store = gw.responses
    if store is None or not await store.delete(key, response_id):
        raise _missing(response_id)
    return {"id": response_id, "object": "response", "deleted": True}
