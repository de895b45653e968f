"""The gateway's ASGI application: the door ahead of FastAPI."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from fastapi import APIRouter, FastAPI
from starlette.datastructures import State

from app.door.entrance import Door
from app.door.entry import Entry
from app.proxy.downstream import Receive, Send

ASGI = Callable[[Any, Receive, Send], Awaitable[None]]


class GatewayApp:
    """POSTs to the surface registry's routes (``by_path``: chat, completions, Messages...) are
    served in plain ASGI by the ``door`` (the route's ``Entry``, found by one dict lookup), ahead
    of FastAPI's middleware, routing and dependency injection, which together cost about as much
    CPU per request as relaying the whole answer; everything else goes to FastAPI (``api``).
    CORS on or off, those POSTs take this one path: with CORS configured the door's answer goes
    out through ``wrap`` (``CORSMiddleware`` around the door), and FastAPI, with the same CORS
    middleware, answers the browsers' preflight ``OPTIONS``. ``state`` and ``router`` are
    FastAPI's.

    ``__call__`` returns the coroutine that answers the request rather than awaiting it: one
    coroutine level less under every await of the request (the server awaits it; uvicorn is
    told the app is ASGI 3, ``app.server.run.uvicorn_config``)."""

    def __init__(
        self,
        api: FastAPI,
        door: Door,
        by_path: Mapping[str, Entry],
        *,
        wrap: Callable[[ASGI], ASGI] | None = None,
    ) -> None:
        self.api = api
        self.door = door
        self._by_path = by_path
        self._wrapped = wrap(self._serve) if wrap is not None else None

    @property
    def state(self) -> State:
        return self.api.state

    @property
    def router(self) -> APIRouter:
        return self.api.router

    def __call__(self, scope: Any, receive: Receive, send: Send) -> Awaitable[None]:
        if scope["type"] == "http" and scope["method"] == "POST":
            entry = self._by_path.get(scope["path"])
            if entry is not None:
                if self._wrapped is not None:
                    return self._wrapped(scope, receive, send)
                return self.door.serve(entry, scope, receive, send)
        return self.api(scope, receive, send)

    def _serve(self, scope: Any, receive: Receive, send: Send) -> Awaitable[None]:
        """The door, as an ASGI app (for ``wrap``)."""
        return self.door.serve(self._by_path[scope["path"]], scope, receive, send)
