"""The OpenAI surface as FastAPI sees it: ``/v1/models`` and ``/v1/models/{model}``, and the two
completion routes declared for ``/openapi.json``, 405s and the CORS case; ``app.main.GatewayApp``
serves POSTs to those two itself, ahead of FastAPI (``app.proxy.ingress``)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import Response

from app.api.deps import GatewayDep
from app.api.schema import (
    ChatCompletionRequest,
    CompletionRequest,
    completion_responses,
    error_responses,
    request_body,
)
from app.api.security import ClientKey
from app.errors import ModelNotFound
from app.gateway import Gateway
from app.proxy import ingress as lane
from app.proxy.downstream import Receive, Send
from app.proxy.ingress import Entry
from app.proxy.request import Route

router = APIRouter()


class LaneResponse(Response):
    """A request of the plain-ASGI lane (``app.proxy.ingress.serve_entry``) that FastAPI routed
    (the CORS case): answered by the same code, as FastAPI's response."""

    def __init__(self, gw: Gateway, entry: Entry) -> None:
        super().__init__()  # status and headers are decided by serve_entry
        self._gw = gw
        self._entry = entry

    async def __call__(self, scope: Any, receive: Receive, send: Send) -> None:
        await lane.serve_entry(self._gw, self._entry, scope, receive, send)


def _declare(route: Route, schema: type[Any], name: str) -> None:
    """Declare a completion route for FastAPI (answered by ``app.proxy.ingress.serve_entry``)."""

    async def endpoint(request: Request, gw: GatewayDep) -> Response:
        return LaneResponse(gw, lane.ENTRIES[route])

    endpoint.__name__ = name
    router.add_api_route(
        route.value,
        endpoint,
        methods=["POST"],
        openapi_extra=request_body(schema),
        responses=completion_responses(),
        response_class=Response,
    )


_declare(Route.CHAT, ChatCompletionRequest, "chat_completions")
_declare(Route.COMPLETIONS, CompletionRequest, "completions")


def _cards(gw: Gateway) -> list[dict[str, Any]]:
    """The served models' cards, then an alias's card (``root`` = its target) per alias whose
    target is served."""
    served = gw.pool.served_models()
    data = [gw.pool.card(model) for model in served]
    for alias, target in gw.settings.model_aliases.items():
        if target in served and alias not in served:
            card = gw.pool.card(target)
            card.update(id=alias, root=target, owned_by="dflash-gateway")
            data.append(card)
    return data


@router.get("/v1/models", responses={401: error_responses()[401]})
async def list_models(gw: GatewayDep, key: ClientKey) -> dict[str, Any]:
    return {"object": "list", "data": _cards(gw)}


@router.get(
    "/v1/models/{model:path}",
    responses={status: error_responses()[status] for status in (401, 404)},
)
async def retrieve_model(model: str, gw: GatewayDep, key: ClientKey) -> dict[str, Any]:
    """One card as ``/v1/models`` lists it (a served model or an alias); 404 ``model_not_found``
    otherwise. Model names may hold a slash (``moonshotai/Kimi-K2.5``)."""
    for card in _cards(gw):
        if card.get("id") == model:
            return card
    raise ModelNotFound(f"The model '{model}' does not exist", param="model")
