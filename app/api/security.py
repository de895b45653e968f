"""Who may call the gateway, and how much: API keys (``app.auth``) and per-key limits
(``app.limits``), checked once per request before its body is read — never per stream chunk.

``key_name`` gives the caller's key NAME (None when no keys are configured) or raises a 401 in
OpenAI shape; ``ClientKey`` is it as a dependency (``/v1/models``; the completion routes call it
themselves). ``OpsKey`` guards ``/metrics`` and ``/workers``: with API keys configured they need
one unless ``auth.protect_ops`` is false (the separate metrics port only when it is true: it is
Prometheus's); probes (``/livez``, ``/readyz``, ``/health``) never need a key. ``admit`` checks
the key's token quotas (``app.tenants.quota``) and takes its limiter slot (429 + Retry-After when
over a quota or a limit), and renders the rate-limit headers of every answer to the request
(``app.tenants.headers``); ``release`` gives the slot back once the response has been sent
(``app.proxy.ingress``, which also charges the answer's tokens to the quotas).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Annotated

from fastapi import Depends, Request

from app.auth import bearer_token
from app.errors import AuthenticationFailed, RateLimited
from app.gateway import Gateway
from app.limits import Budget
from app.proxy.headers import single
from app.tenants.config import TenantPolicy
from app.tenants.headers import HeaderStyle

log = logging.getLogger(__name__)

_MISSING = (
    "You didn't provide an API key. You need to provide your API key in an Authorization "
    "header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY)."
)
_WRONG = "Incorrect API key provided."


def key_name(authorization: str | None, gw: Gateway) -> str | None:
    """The caller's key name (from its Authorization header); None when the gateway is open.
    Raises ``AuthenticationFailed``."""
    keys = gw.keys
    if keys.open:
        return None
    token = bearer_token(authorization)
    if token is None:
        raise AuthenticationFailed(_MISSING)
    name = keys.authenticate(token)
    if name is None:
        raise AuthenticationFailed(_WRONG)
    return name


def authorization(headers: list[tuple[bytes, bytes]]) -> str | None:
    """The request's Authorization header (ASGI raw headers); more than one is a 400."""
    value = single(headers, b"authorization")
    return value.decode("latin-1") if value is not None else None


async def client_key(request: Request) -> str | None:
    """The caller's key name on ``/v1/models``: from Authorization, else from Anthropic's
    ``x-api-key`` (clients of the Messages API send only that)."""
    gw: Gateway = request.app.state.gateway
    headers = request.scope["headers"]
    value = authorization(headers)
    if value is None:
        key = single(headers, b"x-api-key")
        value = None if key is None else "Bearer " + key.decode("latin-1").strip()
    return key_name(value, gw)


def ops_key_of(
    gw: Gateway, headers: list[tuple[bytes, bytes]], *, metrics_port: bool = False
) -> None:
    """``/metrics`` and ``/workers`` need a key when keys are configured (401/400), unless
    ``auth.protect_ops`` is false; on the metrics port only when it is true."""
    protect = gw.settings.auth.protect_ops
    if protect if protect is not None else not metrics_port:
        key_name(authorization(headers), gw)


async def ops_key(request: Request) -> None:
    ops_key_of(request.app.state.gateway, request.scope["headers"])


ClientKey = Annotated[str | None, Depends(client_key)]
OpsKey = Depends(ops_key)


async def admit(
    gw: Gateway,
    key: str | None,
    policy: TenantPolicy,
    style: HeaderStyle,
    headers: list[tuple[bytes, bytes]],
) -> contextlib.AsyncExitStack | None:
    """Count the request for its key, check its token quotas and take its limiter slot
    (``RateLimited`` when over a quota or a limit; a request refused by its quota still spends
    one of its key's requests, as OpenAI counts refused requests). The key's rate-limit
    headers, in ``style``, are added to ``headers`` for the answer, refusals included. The
    returned stack releases the slot; None when there is nothing to release."""
    if key is None:
        return None
    gw.metrics.record_key_request(key)
    quota = gw.quota
    state = await quota.check(key, policy) if quota is not None else None
    tokens = state.tokens if state is not None else None
    requests: Budget | None = None
    stack = contextlib.AsyncExitStack()
    try:
        if gw.limiter is not None:
            requests = await stack.enter_async_context(gw.limiter.hold(key))
        refusal = state.refusal if state is not None else None
        if refusal is not None:
            gw.metrics.record_quota_rejection(key, refusal.quota)
            raise RateLimited(refusal.message, retry_after=refusal.retry_after)
    except RateLimited as refused:
        headers += style(requests if refused.budget is None else refused.budget, tokens)
        await stack.aclose()
        raise
    headers += style(requests, tokens)
    return stack


async def release(stack: contextlib.AsyncExitStack) -> None:
    try:
        await stack.aclose()
    except Exception:  # a limiter that fails to release must not fail the request
        log.exception("releasing a per-key limit failed")
