"""Overload on a real gateway: per-key limits → 429 + Retry-After (in process and shared through a
real redis-server); every worker at capacity with a full admission queue → 503 + Retry-After at
once, not after the queue timeout. Streams are held open with the emulator's gate, so nothing
depends on timing."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import httpx

from tests.e2e.conftest import poll
from tests.security.stack import CHAT, chat, emulator, error_of, start_gateway
from tests.support.procs import ManagedProcess, ProcessManager

KEY_A = "sk-team-a-0123456789abcdef"
KEY_B = "sk-team-b-fedcba9876543210"
KEYS = f"team-a:{KEY_A},team-b:{KEY_B}"


def _auth(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def _post(gw: ManagedProcess, key: str | None = None, **extra: Any) -> httpx.Response:
    headers = _auth(key) if key else {}
    return httpx.post(gw.url + CHAT, json=chat(**extra), headers=headers, timeout=20)


def _gate(emu: ManagedProcess, body: dict[str, Any]) -> None:
    httpx.post(emu.url + "/emulator/gate", json=body, timeout=5).raise_for_status()


@contextmanager
def held_stream(gw: ManagedProcess, key: str | None = None) -> Iterator[list[str]]:
    """A stream that has relayed its first event and is held by the emulator's gate; yields the
    lines read so far, and reads the rest (once the test released the gate) on exit."""
    headers = _auth(key) if key else {}
    lines: list[str] = []
    with (
        httpx.Client(timeout=30) as client,
        client.stream("POST", gw.url + CHAT, json=chat(stream=True), headers=headers) as response,
    ):
        assert response.status_code == 200
        it = response.iter_lines()
        for line in it:
            lines.append(line)
            if line.startswith("data: "):
                break
        yield lines
        lines.extend(it)
    assert lines[-1] == "data: [DONE]" or lines[-2:] == ["data: [DONE]", ""]


def _retry_after(response: httpx.Response) -> int:
    value = int(response.headers["retry-after"])
    assert value >= 1
    return value


def test_per_key_rate_limit_is_429_with_retry_after(procs: ProcessManager) -> None:
    emu = emulator(procs, "emu", "--speed", "50")
    gw = start_gateway(
        procs,
        [emu],
        env={
            "DFLASH_GATEWAY_API_KEYS": KEYS,
            "DFLASH_GATEWAY_LIMITS__KEY_RATE_PER_S": "0.05",
            "DFLASH_GATEWAY_LIMITS__KEY_BURST": "2",
        },
    )
    assert _post(gw, KEY_A).status_code == 200
    assert _post(gw, KEY_A).status_code == 200
    refused = _post(gw, KEY_A)
    assert refused.status_code == 429
    assert _retry_after(refused) >= 10  # one token per 20 s
    err = error_of(refused)
    assert (err["type"], err["code"]) == ("rate_limit_exceeded", "rate_limit_exceeded")
    assert _post(gw, KEY_B).status_code == 200  # keys are limited separately
    metrics = httpx.get(gw.url + "/metrics", headers={"authorization": f"Bearer {KEY_B}"}).text
    assert 'dflash_gateway_key_requests_total{key="team-a"} 3.0' in metrics


def test_per_key_concurrency_limit_is_429_and_the_slot_comes_back(
    procs: ProcessManager,
) -> None:
    emu = emulator(procs, "emu", "--speed", "50")
    gw = start_gateway(
        procs,
        [emu],
        env={"DFLASH_GATEWAY_API_KEYS": KEYS, "DFLASH_GATEWAY_LIMITS__KEY_MAX_CONCURRENT": "1"},
    )
    _gate(emu, {"hold_after_chunks": 1})
    with held_stream(gw, KEY_A):
        refused = _post(gw, KEY_A)
        assert refused.status_code == 429
        _retry_after(refused)
        assert "concurrent" in error_of(refused)["message"]
        _gate(emu, {"release": True})
    assert _post(gw, KEY_A).status_code == 200  # released when the first stream ended


def test_redis_shares_the_concurrency_limit_between_replicas(
    procs: ProcessManager, redis_url: str
) -> None:
    emu = emulator(procs, "emu", "--speed", "50")
    env = {
        "DFLASH_GATEWAY_API_KEYS": KEYS,
        "DFLASH_GATEWAY_LIMITS__KEY_MAX_CONCURRENT": "1",
        "DFLASH_GATEWAY_LIMITS__REDIS_URL": redis_url,
    }
    first = start_gateway(procs, [emu], env=env, name="gateway-1")
    second = start_gateway(procs, [emu], env=env, name="gateway-2")
    _gate(emu, {"hold_after_chunks": 1})
    with held_stream(first, KEY_A):
        refused = _post(second, KEY_A)
        assert refused.status_code == 429
        _retry_after(refused)
        _gate(emu, {"release": True})
    assert _post(second, KEY_A).status_code == 200


def test_full_admission_queue_is_503_at_once(procs: ProcessManager) -> None:
    emu = emulator(procs, "emu", "--speed", "50")
    gw = start_gateway(
        procs,
        [emu],
        env={
            "DFLASH_GATEWAY_ADMISSION__PER_WORKER_CAP": "1",
            "DFLASH_GATEWAY_ADMISSION__QUEUE_SIZE": "1",
            # Far beyond the client's own timeout: a 503 must not wait for it.
            "DFLASH_GATEWAY_ADMISSION__QUEUE_TIMEOUT_S": "600",
        },
    )
    _gate(emu, {"hold_after_chunks": 1})
    with ThreadPoolExecutor(1) as pool:
        with held_stream(gw):
            # One more waits in the queue (it is served once the held stream ends)...
            waiting = pool.submit(_post, gw)
            try:
                poll(lambda: httpx.get(gw.url + "/workers").json()["queued"] == 1, timeout=10)
                # ...and the next finds the queue full: 503 + Retry-After, long before 600 s.
                refused = _post(gw)
            finally:
                _gate(emu, {"release": True})
            assert refused.status_code == 503
            _retry_after(refused)
            assert error_of(refused)["code"] == "service_unavailable"
            assert "127.0.0.1" not in refused.text
        assert waiting.result(timeout=20).status_code == 200
