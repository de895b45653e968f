"""The few ASGI primitives the emulator needs: read a body, answer, stream, notice a disconnect.

The emulator is a plain ASGI app (no framework) so one process can stream well over a thousand
SSE events a second on a small machine.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from typing import Any

import orjson

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

JSON = b"application/json"
TEXT = b"text/plain; charset=utf-8"
SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8")]


class ConnectionDrop(Exception):
    """Raised after the response started: the server closes the connection mid-stream."""


class BodyError(ValueError):
    pass


async def read_body(receive: Receive, limit: int = 64 * 1024 * 1024) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise BodyError("client went away while sending the body")
        body = message.get("body", b"")
        size += len(body)
        if size > limit:
            raise BodyError("request body too large")
        chunks.append(body)
        if not message.get("more_body", False):
            return b"".join(chunks)


async def respond(
    send: Send,
    status: int,
    body: bytes = b"",
    content_type: bytes | None = JSON,
    headers: Iterable[tuple[bytes, bytes]] = (),
) -> None:
    head = [(b"content-length", str(len(body)).encode())]
    if content_type is not None:
        head.append((b"content-type", content_type))
    head.extend(headers)
    await send({"type": "http.response.start", "status": status, "headers": head})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def respond_json(send: Send, status: int, obj: Any) -> None:
    await respond(send, status, orjson.dumps(obj))


def header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            return bytes(value).decode("latin-1")
    return None


def query(scope: Scope) -> dict[str, str]:
    raw = bytes(scope.get("query_string", b"")).decode("latin-1")
    out: dict[str, str] = {}
    for part in raw.split("&"):
        if part:
            key, _, value = part.partition("=")
            out[key] = value.replace("%2C", ",").replace("%2c", ",")
    return out


def watch_disconnect(receive: Receive, on_disconnect: Callable[[], object]) -> asyncio.Task[None]:
    """A task that calls ``on_disconnect`` when the client goes away; cancel it when done."""

    async def watch() -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                on_disconnect()
                return

    return asyncio.get_running_loop().create_task(watch())
