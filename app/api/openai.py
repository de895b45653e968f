"""The OpenAI surface: thin handlers that validate, then hand the request to the proxy."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import Response

from app.accesslog import AccessRecord
from app.api.deps import Gateway, GatewayDep, RequestIdDep
from app.errors import GatewayError, ModelNotFound, PayloadTooLarge, ServiceUnavailable
from app.protocol import ParsedRequest, Route, parse_request
from app.proxy import Job, ProxyResponse
from app.routing.keys import routing_key
from app.routing.policies import RoutingContext
from app.upstream.client import forwardable_headers

router = APIRouter()


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refusing (413) as soon as it is known to exceed ``limit`` bytes."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"request body is larger than {limit} bytes")
    parts: list[bytes] = []
    size = 0
    async for part in request.stream():
        size += len(part)
        if size > limit:
            raise PayloadTooLarge(f"request body is larger than {limit} bytes")
        parts.append(part)
    return b"".join(parts)


def _check_model(gw: Gateway, parsed: ParsedRequest) -> None:
    if not gw.accepting:
        raise ServiceUnavailable(
            "the gateway is shutting down; retry on another replica",
            retry_after=gw.settings.admission.retry_after_s,
        )
    served = gw.pool.served_models()
    if parsed.served_model in served:
        return
    if not served:
        raise ServiceUnavailable(
            "no healthy worker yet; try again shortly",
            retry_after=gw.settings.admission.retry_after_s,
        )
    raise ModelNotFound(f"The model `{parsed.model}` does not exist.", param="model")


async def _proxy(request: Request, gw: Gateway, request_id: str, route: Route) -> Response:
    started = gw.proxy.now()
    settings = gw.settings
    try:
        raw = await read_body(request, settings.limits.max_body_bytes)
        parsed = parse_request(raw, route, limits=settings.limits, aliases=settings.model_aliases)
        _check_model(gw, parsed)
    except GatewayError as exc:
        gw.metrics.record_request(route.value, "other", exc.status)
        raise
    headers = [
        (k, v) for k, v in forwardable_headers(request.scope["headers"]) if k != b"x-request-id"
    ]
    headers.append((b"x-request-id", request_id.encode("ascii")))
    ctx = RoutingContext(parsed.served_model, routing_key(request.headers, parsed.body))
    record = AccessRecord(request_id, route.value, parsed.served_model, parsed.stream)
    job = Job(parsed, headers, request_id, ctx, record, started)
    return ProxyResponse(gw.proxy, job)


@router.post("/v1/chat/completions")
async def chat_completions(request: Request, gw: GatewayDep, request_id: RequestIdDep) -> Response:
    return await _proxy(request, gw, request_id, Route.CHAT)


@router.post("/v1/completions")
async def completions(request: Request, gw: GatewayDep, request_id: RequestIdDep) -> Response:
    return await _proxy(request, gw, request_id, Route.COMPLETIONS)


@router.get("/v1/models")
async def list_models(gw: GatewayDep) -> dict[str, Any]:
    served = gw.pool.served_models()
    data = [gw.pool.card(model) for model in served]
    for alias, target in gw.settings.model_aliases.items():
        if target in served and alias not in served:
            card = gw.pool.card(target)
            card.update(id=alias, root=target, owned_by="dflash-gateway")
            data.append(card)
    return {"object": "list", "data": data}
