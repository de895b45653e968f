"""``create_emulator_app(config)``: the emulated SGLang (or vLLM: ``config.engine``) DFLASH worker
as an ASGI application.

Routes (method, path) -> handler; unknown paths answer 404 and wrong methods 405 with FastAPI's
``{"detail": ...}`` body, as both servers do. A vLLM worker has its own route table (no
``/v1/loads``, ``/abort_request``, ...: ``app.emulator.vllm``).
"""

from __future__ import annotations

import random
import secrets
from collections.abc import Awaitable, Callable
from functools import partial

from app.emulator import bootstrap, control, counting, ops, vllm
from app.emulator.asgi import Receive, Scope, Send, header, respond_json
from app.emulator.engine import Clock
from app.emulator.openai import handle_generate
from app.emulator.replay import ReplayBook
from app.emulator.worker import EmulatedWorker, EmulatorConfig

Handler = Callable[[EmulatedWorker, Scope, Receive, Send], Awaitable[None]]


def _routes(replay: ReplayBook | None) -> dict[str, dict[str, Handler]]:
    generate_chat: Handler = partial(_generate, replay, "chat")
    generate_text: Handler = partial(_generate, replay, "completion")
    return {
        "/v1/chat/completions": {"POST": generate_chat},
        "/v1/completions": {"POST": generate_text},
        "/v1/messages/count_tokens": {"POST": counting.count_tokens},
        "/v1/tokenize": {"POST": counting.tokenize},
        "/tokenize": {"POST": counting.tokenize},
        "/v1/models": {"GET": ops.models},
        "/health": {"GET": ops.health},
        "/health_generate": {"GET": ops.health},
        "/ready": {"GET": ops.ready},
        "/server_info": {"GET": ops.server_info},
        "/get_server_info": {"GET": ops.server_info},
        "/model_info": {"GET": ops.model_info},
        "/get_model_info": {"GET": ops.model_info},
        "/v1/loads": {"GET": ops.loads},
        "/abort_request": {"POST": ops.abort_request},
        "/flush_cache": {"GET": ops.flush_cache, "POST": ops.flush_cache},
        "/metrics": {"GET": ops.metrics},
        "/emulator/faults": {"GET": control.get_faults, "POST": control.set_faults},
        "/emulator/gate": {"GET": control.get_gate, "POST": control.set_gate},
        "/emulator/stats": {"GET": control.get_stats, "DELETE": control.reset_stats},
    }


def _vllm_routes(replay: ReplayBook | None, dev_mode: bool) -> dict[str, dict[str, Handler]]:
    """vLLM's OpenAI server: generation, models, health, version, metrics, server info in dev
    mode only (and the emulator's own control endpoints)."""
    routes: dict[str, dict[str, Handler]] = {
        "/v1/chat/completions": {"POST": partial(_generate, replay, "chat")},
        "/v1/completions": {"POST": partial(_generate, replay, "completion")},
        "/v1/models": {"GET": ops.models},
        "/health": {"GET": ops.health},
        "/version": {"GET": vllm.version},
        "/metrics": {"GET": ops.metrics},
        "/emulator/faults": {"GET": control.get_faults, "POST": control.set_faults},
        "/emulator/gate": {"GET": control.get_gate, "POST": control.set_gate},
        "/emulator/stats": {"GET": control.get_stats, "DELETE": control.reset_stats},
    }
    if dev_mode:
        routes["/server_info"] = {"GET": vllm.server_info}
    return routes


async def _generate(
    replay: ReplayBook | None,
    kind: str,
    worker: EmulatedWorker,
    scope: Scope,
    receive: Receive,
    send: Send,
) -> None:
    await handle_generate(worker, replay, kind, scope, receive, send)


_OPEN_PREFIXES = ("/health", "/ready", "/metrics", "/emulator/")


def _authorized(scope: Scope, path: str, key: str) -> bool:
    """SGLang's ``--api-key``: a bearer token on everything but health, readiness and metrics
    (and the emulator's own control endpoints, which tests drive)."""
    if scope["method"] == "OPTIONS" or path.startswith(_OPEN_PREFIXES):
        return True
    scheme, _, token = (header(scope, b"authorization") or "").partition(" ")
    return scheme.lower() == "bearer" and secrets.compare_digest(token, key)


class EmulatorApp:
    """The ASGI callable; ``worker`` holds all state (tests may read it in-process)."""

    def __init__(self, worker: EmulatedWorker) -> None:
        self.worker = worker
        replay = ReplayBook(worker) if worker.config.replay else None
        self._routes = (
            _vllm_routes(replay, worker.config.vllm_dev_mode)
            if worker.config.vllm
            else _routes(replay)
        )

    def _on_bootstrap_port(self, scope: Scope) -> bool:
        """A prefill server's bootstrap port is a second socket of the same server."""
        disagg = self.worker.config.disagg
        server = scope.get("server")
        return (
            disagg.mode == "prefill" and server is not None and server[1] == disagg.bootstrap_port
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            if self._on_bootstrap_port(scope):
                await bootstrap.serve(self.worker, scope, receive, send)
                return
            path = scope["path"]
            key = self.worker.config.api_key
            if key is not None and not _authorized(scope, path, key):
                await respond_json(send, 401, {"error": "Unauthorized"})
                return
            methods = self._routes.get(path)
            if methods is None and path.startswith("/v1/models/"):
                methods = {"GET": ops.model_card}
            if methods is None:
                await respond_json(send, 404, {"detail": "Not Found"})
                return
            handler = methods.get(scope["method"])
            if handler is None:
                await respond_json(send, 405, {"detail": "Method Not Allowed"})
                return
            await handler(self.worker, scope, receive, send)
        elif scope["type"] == "lifespan":
            await self._lifespan(receive, send)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                self.worker.stats.close()
                if self.worker.publisher is not None:
                    self.worker.publisher.close()
                if self.worker.disagg is not None:
                    await self.worker.disagg.close()
                await send({"type": "lifespan.shutdown.complete"})
                return


def create_emulator_app(
    config: EmulatorConfig, *, clock: Clock | None = None, rng: random.Random | None = None
) -> EmulatorApp:
    return EmulatorApp(EmulatedWorker(config, clock=clock, rng=rng))
