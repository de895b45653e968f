"""Real gateway processes for the security tests (emulated workers behind them, loopback only)."""

from __future__ import annotations

from typing import Any

import httpx

from tests.e2e.conftest import EMULATE, FAST_HEALTH, emulator
from tests.support.procs import PYTHON, ManagedProcess, ProcessManager

MODEL = "moonshotai/Kimi-K2.5"
CHAT = "/v1/chat/completions"

__all__ = ["CHAT", "EMULATE", "MODEL", "chat", "emulator", "error_of", "start_gateway"]


def start_gateway(
    procs: ProcessManager,
    workers: list[ManagedProcess],
    *,
    args: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
    name: str = "gateway",
) -> ManagedProcess:
    argv = [PYTHON, "-m", "app", "serve", "--port", "{port}", *args]
    for worker in workers:
        argv += ["--worker-url", worker.url]
    return procs.start(
        argv, name=name, ready_path="/readyz", ready_status=200, env={**FAST_HEALTH, **(env or {})}
    )


def chat(**extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": MODEL,
        "max_tokens": 16,
        "messages": [{"role": "user", "content": "hi"}],
    }
    return body | extra


def error_of(response: httpx.Response) -> dict[str, Any]:
    """The OpenAI error object of a response, checking the envelope's exact shape."""
    body = response.json()
    assert set(body) == {"error"}, body
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]  # type: ignore[no-any-return]
