"""The OpenAI surface: thin handlers that validate, then hand the request to the proxy."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from starlette.requests import ClientDisconnect
from starlette.responses import Response

from app.accesslog import AccessRecord
from app.api.deps import Gateway, GatewayDep, RequestIdDep
from app.api.schema import (
    ChatCompletionRequest,
    CompletionRequest,
    completion_responses,
    error_responses,
    request_body,
)
from app.api.security import ClientKey, KeyedResponse, admit, release
from app.errors import (
    GatewayError,
    InvalidRequest,
    ModelNotFound,
    PayloadTooLarge,
    ServiceUnavailable,
)
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
    try:
        async for part in request.stream():
            size += len(part)
            if size > limit:
                raise PayloadTooLarge(f"request body is larger than {limit} bytes")
            parts.append(part)
    except ClientDisconnect:  # gone, or cut off by the server's body deadline (app.httpguard)
        raise InvalidRequest(
            "the client closed the connection", status=499, code="client_closed_request"
        ) from None
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


async def _proxy(
    request: Request, gw: Gateway, request_id: str, route: Route, key: str | None
) -> Response:
    started = gw.proxy.now()
    settings = gw.settings
    slot = None
    try:
        slot = await admit(gw, key)  # per-key limits: 429 before the body is even read
        raw = await read_body(request, settings.limits.max_body_bytes)
        parsed = parse_request(raw, route, limits=settings.limits, aliases=settings.model_aliases)
        _check_model(gw, parsed)
    except GatewayError as exc:
        if slot is not None:
            await release(slot)
        gw.metrics.record_request(route.value, "other", exc.status)
        raise
    except BaseException:
        if slot is not None:
            await release(slot)
        raise
    headers = [
        (k, v) for k, v in forwardable_headers(request.scope["headers"]) if k != b"x-request-id"
    ]
    headers.append((b"x-request-id", request_id.encode("ascii")))
    ctx = RoutingContext(parsed.served_model, routing_key(request.headers, parsed.body))
    record = AccessRecord(request_id, route.value, parsed.served_model, parsed.stream, key=key)
    job = Job(parsed, headers, request_id, ctx, record, started)
    response = ProxyResponse(gw.proxy, job)
    if key is None or slot is None:
        return response
    return KeyedResponse(response, key=key, record=record, release=slot, metrics=gw.metrics)


@router.post(
    "/v1/chat/completions",
    openapi_extra=request_body(ChatCompletionRequest),
    responses=completion_responses(),
    response_class=Response,
)
async def chat_completions(
    request: Request, gw: GatewayDep, request_id: RequestIdDep, key: ClientKey
) -> Response:
    return await _proxy(request, gw, request_id, Route.CHAT, key)


@router.post(
    "/v1/completions",
    openapi_extra=request_body(CompletionRequest),
    responses=completion_responses(),
    response_class=Response,
)
async def completions(
    request: Request, gw: GatewayDep, request_id: RequestIdDep, key: ClientKey
) -> Response:
    return await _proxy(request, gw, request_id, Route.COMPLETIONS, key)


@router.get("/v1/models", responses={401: error_responses()[401]})
async def list_models(gw: GatewayDep, key: ClientKey) -> dict[str, Any]:
    served = gw.pool.served_models()
    data = [gw.pool.card(model) for model in served]
    for alias, target in gw.settings.model_aliases.items():
        if target in served and alias not in served:
            card = gw.pool.card(target)
            card.update(id=alias, root=target, owned_by="dflash-gateway")
            data.append(card)
    return {"object": "list", "data": data}
