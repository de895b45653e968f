"""``/v1/models`` and ``/v1/models/{model}``. The completion routes are the surface registry's
(``app.surfaces``, declared for FastAPI by ``app.api.surfaces``)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from app.api.deps import GatewayDep
from app.api.security import ClientKey
from app.errors import ModelNotFound
from app.gateway import Gateway
from app.model_names import is_pattern, resolve, unknown_model
from app.openai.schema import error_responses

router = APIRouter()


def _cards(gw: Gateway) -> list[dict[str, Any]]:
    """The served models' cards, then an alias's card (``root`` = its target) per alias whose
    target is served; a pattern (``claude-*``) names no model, so it has none."""
    served = gw.pool.served_models()
    data = [gw.pool.card(model) for model in served]
    for alias, target in gw.settings.model_aliases.items():
        if target in served and alias not in served and not is_pattern(alias):
            data.append(_alias_card(gw, alias, target))
    return data


def _alias_card(gw: Gateway, alias: str, target: str) -> dict[str, Any]:
    card = gw.pool.card(target)
    card.update(id=alias, root=target, owned_by="dflash-gateway")
    return card


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
    aliases = gw.settings.model_aliases
    served = gw.pool.served_models()
    target = resolve(aliases, model)
    if target != model and target in served:  # a name a pattern alias answers
        return _alias_card(gw, model, target)
    raise ModelNotFound(unknown_model(model, served, aliases), param="model")
