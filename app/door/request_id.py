"""X-Request-Id: accepted from the client (if sane) or minted, echoed on every response and sent
on to the worker; and the gateway's own id for every request, unique (32 random hex digits), in
the access and usage records, the trace and the gateway's log.

A client's own ``X-Request-Id`` (the first, when sent more than once) is never the records' id:
any client could repeat one, so a billing job de-duplicating usage lines by it would undercount.
It is kept in the records as ``client_request_id`` (escaped: printable ASCII, anything else as
``\\xNN``; at most ``CLIENT_MAX_BYTES`` bytes of it), so a client finds its requests there by the
id it sent and got back. Without a sane one of its own, the client gets the gateway's id back.

A pure ASGI middleware (no ``BaseHTTPMiddleware``) puts it on FastAPI's own answers; the door
(ahead of FastAPI) puts it on the answers of the completion routes itself.
"""

from __future__ import annotations

import os
from typing import Any

from app.door.reject import client_text
from app.proxy.downstream import Message, Receive, Send

HEADER = b"x-request-id"
CLIENT_MAX_BYTES = 128
_CLIENT = "client_request_id"
_ECHO = "echo_request_id"


def _acceptable(value: bytes) -> bool:
    return 0 < len(value) <= CLIENT_MAX_BYTES and all(0x21 <= c <= 0x7E for c in value)


def request_id_of(scope: dict[str, Any]) -> str:
    """The request's own id: the one already given to it, or a new one (the client's own
    ``X-Request-Id``, if any, kept as ``client_request_id_of`` and echoed, ``echo_id_of``)."""
    state = scope.setdefault("state", {})
    known: str | None = state.get("request_id")
    if known is not None:
        return known
    request_id = os.urandom(16).hex()
    state["request_id"] = state[_ECHO] = request_id
    for name, value in scope["headers"]:
        if name == HEADER:
            state[_CLIENT] = client_text(value[:CLIENT_MAX_BYTES])
            if _acceptable(value):
                state[_ECHO] = value.decode("ascii")
            break
    return request_id


def echo_id_of(scope: dict[str, Any]) -> str:
    """The ``X-Request-Id`` the client gets back and the worker is sent: the client's own when
    sane (printable ASCII, at most ``CLIENT_MAX_BYTES``), else the gateway's (``request_id_of``)."""
    request_id_of(scope)
    echo: str = scope["state"][_ECHO]
    return echo


def client_request_id_of(scope: dict[str, Any]) -> str | None:
    """The client's own ``X-Request-Id``, escaped and capped (None when it sent none)."""
    request_id_of(scope)
    client: str | None = scope["state"].get(_CLIENT)
    return client


class RequestIdMiddleware:
    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        raw = echo_id_of(scope).encode("ascii")

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", ()))
                if not any(k.lower() == HEADER for k, _ in headers):
                    headers.append((HEADER, raw))
                    message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_id)
