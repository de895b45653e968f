"""The key checks FastAPI's routes depend on (``app.door.api_keys`` does the checking).

``ClientKey`` is the caller's key name as a dependency (``/v1/models``, the stored responses; the
completion routes are checked by the door). ``OpsKey`` guards ``/metrics`` and ``/workers``:
with API keys configured they need one unless ``auth.protect_ops`` is false; probes
(``/livez``, ``/readyz``, ``/health``) never need a key.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from app.door.api_keys import authorization, key_name, ops_key_of
from app.gateway import Gateway
from app.proxy.headers import single


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


async def ops_key(request: Request) -> None:
    ops_key_of(request.app.state.gateway, request.scope["headers"])


ClientKey = Annotated[str | None, Depends(client_key)]
OpsKey = Depends(ops_key)
