"""X-Request-Id: accepted from the client (if sane) or minted, and echoed on every response.

A pure ASGI middleware (no ``BaseHTTPMiddleware``): it touches only the response start message.
It also leaves the send it was given as the ASGI scope extension ``SEND_EXTENSION`` so the
streaming proxy response can skip the per-chunk wrapper layers between here and the route.
"""

from __future__ import annotations

import os
from typing import Any

from app.proxy.downstream import Message, Receive, Send

HEADER = b"x-request-id"
SEND_EXTENSION = "dflash.outer_send"
_MAX_LEN = 128


def _acceptable(value: bytes) -> bool:
    return 0 < len(value) <= _MAX_LEN and all(0x21 <= c <= 0x7E for c in value)


def request_id_of(scope: dict[str, Any]) -> str:
    """The request's id: the one already given to it, the client's (if sane) or a new one."""
    state = scope.setdefault("state", {})
    known: str | None = state.get("request_id")
    if known is not None:
        return known
    raw = b""
    for name, value in scope["headers"]:
        if name == HEADER:
            raw = value
            break
    request_id = raw.decode("ascii") if _acceptable(raw) else os.urandom(16).hex()
    state["request_id"] = request_id
    return request_id


def outer_send(scope: dict[str, Any], send: Send) -> Send:
    """The send ``RequestIdMiddleware`` was given, if it ran for this request, else ``send``."""
    extensions = scope.get("extensions")
    outer: Send | None = extensions.get(SEND_EXTENSION) if extensions else None
    return outer or send


class RequestIdMiddleware:
    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        raw = request_id_of(scope).encode("ascii")
        scope.setdefault("extensions", {})[SEND_EXTENSION] = send

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", ()))
                if not any(k.lower() == HEADER for k, _ in headers):
                    headers.append((HEADER, raw))
                    message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_id)
