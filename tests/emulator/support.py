"""Helpers for talking to an emulator in tests: SSE parsing and polling."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import orjson

CHAT = {"messages": [{"role": "user", "content": "Tell me about gardens."}]}


def events(response: httpx.Response | Iterator[str]) -> Iterator[Any]:
    """Each SSE ``data:`` payload: decoded JSON, or the string ``"[DONE]"``."""
    lines = response.iter_lines() if isinstance(response, httpx.Response) else response
    for line in lines:
        if not line.startswith("data: "):
            continue
        payload = line[len("data: ") :]
        yield "[DONE]" if payload == "[DONE]" else orjson.loads(payload)


def stream_events(client: httpx.Client, path: str, body: dict[str, Any]) -> list[Any]:
    with client.stream("POST", path, json={**body, "stream": True}) as response:
        assert response.status_code == 200, response.read()
        return list(events(response))


def wait_for(predicate: Callable[[], Any], timeout: float = 10.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def stats(client: httpx.Client, **params: Any) -> dict[str, Any]:
    response = client.get("/emulator/stats", params=params)
    response.raise_for_status()
    data: dict[str, Any] = response.json()
    return data


def record(client: httpx.Client, rid: str) -> dict[str, Any]:
    """The finished request's ground-truth record (waits for it)."""
    found: dict[str, Any] = wait_for(
        lambda: next((r for r in stats(client, rid=rid)["requests"] if r["rid"] == rid), None),
        what=f"record {rid}",
    )
    return found
