"""What handlers may use, as ``Annotated[..., Depends(...)]`` aliases over ``app.state``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated

from fastapi import Depends, Request

from app.auth import KeyStore
from app.config import Settings
from app.limits import Limiter
from app.metrics import Metrics
from app.proxy import Proxy
from app.workers.pool import WorkerPool


@dataclass(slots=True)
class Gateway:
    """Everything ``create_app`` builds for one process."""

    settings: Settings
    pool: WorkerPool
    proxy: Proxy
    metrics: Metrics
    keys: KeyStore = field(default_factory=KeyStore)  # no keys: open
    limiter: Limiter | None = None  # per-key limits, when configured
    draining: bool = False  # SIGTERM received: not ready (new requests served a little longer)
    accepting: bool = True  # False once the drain window closed: new requests get 503


async def get_gateway(request: Request) -> Gateway:
    gateway: Gateway = request.app.state.gateway
    return gateway


async def get_request_id(request: Request) -> str:
    request_id: str = request.scope["state"]["request_id"]
    return request_id


GatewayDep = Annotated[Gateway, Depends(get_gateway)]
RequestIdDep = Annotated[str, Depends(get_request_id)]
