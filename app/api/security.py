"""Who may call the gateway, and how much: API keys (``app.auth``) and per-key limits
(``app.limits``), checked once per request before its body is read — never per stream chunk.

``key_name`` gives the caller's key NAME (None when no keys are configured) or raises a 401 in
OpenAI shape; ``ClientKey`` is it as a dependency (``/v1/models``; the completion routes call it
themselves). ``OpsKey`` guards ``/metrics`` and ``/workers`` only when ``auth.protect_ops`` is
set; probes (``/livez``, ``/readyz``, ``/health``) never need a key. ``admit`` takes the key's
limiter slot (429 + Retry-After when over a limit) and ``release`` gives it back once the
response has been sent (``app.proxy.ingress``).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Annotated

from fastapi import Depends, Request

from app.auth import bearer_token
from app.errors import AuthenticationFailed
from app.gateway import Gateway
from app.proxy.headers import single

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


def ops_key_of(gw: Gateway, headers: list[tuple[bytes, bytes]]) -> None:
    """``/metrics`` and ``/workers`` need a key when ``auth.protect_ops`` is set (401/400)."""
    if gw.settings.auth.protect_ops:
        key_name(authorization(headers), gw)


async def ops_key(request: Request) -> None:
    ops_key_of(request.app.state.gateway, request.scope["headers"])


ClientKey = Annotated[str | None, Depends(client_key)]
OpsKey = Depends(ops_key)


async def admit(gw: Gateway, key: str | None) -> contextlib.AsyncExitStack | None:
    """Count the request for its key and take the key's limiter slot (``RateLimited`` if over a
    limit). The returned stack releases the slot; None when there is nothing to release."""
    if key is None:
        return None
    gw.metrics.record_key_request(key)
    stack = contextlib.AsyncExitStack()
    if gw.limiter is not None:
        await stack.enter_async_context(gw.limiter.hold(key))
    return stack


async def release(stack: contextlib.AsyncExitStack) -> None:
    try:
        await stack.aclose()
    except Exception:  # a limiter that fails to release must not fail the request
        log.exception("releasing a per-key limit failed")
