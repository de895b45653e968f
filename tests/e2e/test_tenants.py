"""Priority classes and the admission queue through real processes: a gateway (one slot on its one
worker, two API keys with their own priority defaults and ceilings, workers.priority_scheduling
on) in front of an emulated worker started with --enable-priority-scheduling, and a second
gateway with priority scheduling off."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.e2e.conftest import emulator, gateway, poll
from tests.support.procs import ManagedProcess, managed_processes

ALPHA = "alpha-key-0123456789abcdef"
BETA = "beta-key-0123456789abcdef"
TENANTS = {
    "default": {"priority": "normal", "max_priority": "normal"},
    "keys": {
        "alpha": {"priority": "normal", "max_priority": "high"},
        "beta": {"priority": "low", "max_priority": "normal"},
    },
}
BODY = {"model": "kimi-k2.5", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}


class Stack:
    def __init__(self, emu: ManagedProcess, gw: ManagedProcess, plain: ManagedProcess) -> None:
        self.emu, self.gw, self.plain = emu, gw, plain

    def chat(self, key: str, request_id: str, *, url: str | None = None, **headers: str) -> Any:
        response = httpx.post(
            (url or self.gw.url) + "/v1/chat/completions",
            json=BODY,
            headers={"Authorization": f"Bearer {key}", "X-Request-Id": request_id, **headers},
            timeout=30,
        )
        return response

    def gateway_id(self, client_id: str) -> str:
        """The gateway's own id of the request the client sent as ``X-Request-Id: client_id``
        (what the worker is sent), from its access line."""
        line = poll(lambda: self.access(client_id))
        assert line["client_request_id"] == client_id
        return str(line["request_id"])

    def record(self, client_id: str) -> dict[str, Any]:
        return self.worker_record(self.gateway_id(client_id))

    def worker_record(self, request_id: str) -> dict[str, Any]:
        records = httpx.get(self.emu.url + "/emulator/stats", timeout=5).json()["requests"]
        [found] = [r for r in records if r["request_id"] == request_id]
        return found  # type: ignore[no-any-return]

    def seen(self) -> set[str]:
        records = httpx.get(self.emu.url + "/emulator/stats", timeout=5).json()["requests"]
        return {r["request_id"] for r in records}

    def queued(self) -> int:
        ops = {"authorization": f"Bearer {ALPHA}"}  # keys are configured: /workers needs one
        return int(httpx.get(self.gw.url + "/workers", headers=ops, timeout=5).json()["queued"])

    def running(self) -> int:
        loads = httpx.get(self.emu.url + "/v1/loads", timeout=5).json()["loads"]
        return int(loads[0]["num_running_reqs"])

    def gate(self, body: dict[str, Any]) -> None:
        httpx.post(self.emu.url + "/emulator/gate", json=body, timeout=5).raise_for_status()

    def access(self, request_id: str) -> dict[str, Any] | None:
        for line in self.gw.logs().splitlines():
            if request_id in line and line.startswith("{"):
                doc = json.loads(line)
                if doc.get("logger") == "dflash_gateway.access":
                    return doc  # type: ignore[no-any-return]
        return None


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with managed_processes(tmp_path_factory, "tenants") as manager:
        emu = emulator(manager, "emu", "--seed", "3", "--enable-priority-scheduling")
        config = Path(manager.log_dir) / "gateway.yaml"
        config.write_text(
            yaml.safe_dump(
                {
                    "api_keys": [f"alpha:{ALPHA}", f"beta:{BETA}"],
                    "tenants": TENANTS,
                    "admission": {"per_worker_cap": 1, "queue_timeout_s": 120},
                    "log_json": True,
                }
            )
        )
        gw = gateway(
            manager,
            [emu],
            env={
                "DFLASH_GATEWAY_CONFIG_FILE": str(config),
                "DFLASH_GATEWAY_WORKERS__PRIORITY_SCHEDULING": "true",
            },
        )
        plain = gateway(manager, [emu], env={"DFLASH_GATEWAY_CONFIG_FILE": str(config)})
        yield Stack(emu, gw, plain)


@pytest.fixture
def fresh(stack: Stack) -> Iterator[Stack]:
    stack.gate({"release": True})
    yield stack
    stack.gate({"release": True})


def test_the_worker_gets_each_requests_class_clamped_to_its_keys_ceiling(fresh: Stack) -> None:
    cases = [
        (BETA, "beta-default", {}, 0),  # beta's default class: low
        (BETA, "beta-asks-high", {"X-Priority": "high"}, 1),  # lowered to beta's ceiling
        (ALPHA, "alpha-default", {}, 1),
        (ALPHA, "alpha-asks-high", {"X-Priority": "HIGH"}, 2),
        (ALPHA, "alpha-lowers", {"X-Priority": "0"}, 0),  # a client may always lower it
    ]
    for key, request_id, headers, want in cases:
        response = fresh.chat(key, request_id, **headers)
        assert response.status_code == 200, response.text
        assert fresh.record(request_id)["priority"] == want, request_id
        assert fresh.access(request_id)["priority"] == ("low", "normal", "high")[want]


def test_without_priority_scheduling_no_priority_field_is_sent(fresh: Stack) -> None:
    response = fresh.chat(ALPHA, "plain-high", url=fresh.plain.url, **{"X-Priority": "high"})
    assert response.status_code == 200, response.text
    assert fresh.worker_record(response.headers["x-request-id"])["priority"] is None


def test_a_bad_x_priority_is_an_openai_shaped_400(fresh: Stack) -> None:
    for value in ("urgent", "3", ""):
        response = fresh.chat(ALPHA, f"bad-{value}", **{"X-Priority": value})
        assert response.status_code == 400, (value, response.text)
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["param"] == "x-priority"
        assert "low, normal, high" in error["message"]
    # The body field itself stays the gateway's to set.
    response = httpx.post(
        fresh.gw.url + "/v1/chat/completions",
        json={**BODY, "priority": 100},
        headers={"Authorization": f"Bearer {BETA}"},
        timeout=30,
    )
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "priority"


def _send_raw(stack: Stack, key: str, request_id: str, **headers: str) -> socket.socket:
    """A streamed request on a raw connection (its client can leave by closing it)."""
    body = json.dumps({**BODY, "stream": True}).encode()
    head = [
        "POST /v1/chat/completions HTTP/1.1",
        f"Host: 127.0.0.1:{stack.gw.port}",
        "Content-Type: application/json",
        f"Content-Length: {len(body)}",
        f"Authorization: Bearer {key}",
        f"X-Request-Id: {request_id}",
        *(f"{name}: {value}" for name, value in headers.items()),
    ]
    sock = socket.create_connection(("127.0.0.1", stack.gw.port), timeout=30)
    sock.sendall(("\r\n".join(head) + "\r\n\r\n").encode() + body)
    return sock


def _drain(sock: socket.socket) -> bytes:
    data = b""
    while b"data: [DONE]" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    sock.close()
    return data


def test_higher_classes_leave_the_queue_first(fresh: Stack) -> None:
    fresh.gate({"hold_after_chunks": 1})
    holder = _send_raw(fresh, ALPHA, "order-holder")
    poll(lambda: fresh.running() == 1)
    low = _send_raw(fresh, BETA, "order-low")
    poll(lambda: fresh.queued() == 1)
    high = _send_raw(fresh, ALPHA, "order-high", **{"X-Priority": "high"})
    poll(lambda: fresh.queued() == 2)
    fresh.gate({"release": True})
    for sock in (holder, high, low):
        assert b"data: [DONE]" in _drain(sock)
    high_rec, low_rec = fresh.record("order-high"), fresh.record("order-low")
    assert high_rec["started"] < low_rec["started"]
    assert (high_rec["priority"], low_rec["priority"]) == (2, 0)


def test_a_queued_client_that_leaves_is_out_of_the_queue_at_once(fresh: Stack) -> None:
    fresh.gate({"hold_after_chunks": 1})
    holder = _send_raw(fresh, ALPHA, "leave-holder")
    poll(lambda: fresh.running() == 1)
    leaver = _send_raw(fresh, BETA, "leave-leaver")
    poll(lambda: fresh.queued() == 1)
    answers: list[httpx.Response] = []
    stayer = threading.Thread(target=lambda: answers.append(fresh.chat(BETA, "leave-stayer")))
    stayer.start()
    try:
        poll(lambda: fresh.queued() == 2)
        leaver.close()
        # Out of the queue and logged as a 499 while the only slot is still held: nothing
        # waited for a slot to free.
        poll(lambda: fresh.queued() == 1)
        line = poll(lambda: fresh.access("leave-leaver"))
        assert (line["status"], line["outcome"]) == (499, "client_disconnect")
        assert line["queue_ms"] > 0  # how long it waited before it left
        assert fresh.running() == 1 and fresh.queued() == 1
    finally:
        fresh.gate({"release": True})
        stayer.join(30)
    assert b"data: [DONE]" in _drain(holder)
    assert [a.status_code for a in answers] == [200]
    seen = fresh.seen()
    assert fresh.gateway_id("leave-stayer") in seen
    assert fresh.gateway_id("leave-leaver") not in seen  # it never reached the worker
