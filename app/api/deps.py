"""What handlers may use, as ``Annotated[..., Depends(...)]`` aliases over ``app.state``."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from app.gateway import Gateway


async def get_gateway(request: Request) -> Gateway:
    gateway: Gateway = request.app.state.gateway
    return gateway


async def get_request_id(request: Request) -> str:
    request_id: str = request.scope["state"]["request_id"]
    return request_id


GatewayDep = Annotated[Gateway, Depends(get_gateway)]
RequestIdDep = Annotated[str, Depends(get_request_id)]
