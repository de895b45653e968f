"""Every error case of the gateway core, against real emulator and gateway processes."""

from __future__ import annotations

from typing import Any

import httpx
import orjson
import pytest

from tests.e2e.conftest import EMULATE, Stack, emulator, gateway, poll
from tests.support.procs import ManagedProcess, ProcessManager

MODEL = "moonshotai/Kimi-K2.5"
CHAT = "/v1/chat/completions"


def chat(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "max_tokens": 2000, "messages": [{"role": "user", "content": "hi"}]} | (
        extra
    )


def post(gw: ManagedProcess, body: Any = None, *, content: bytes | None = None) -> httpx.Response:
    if content is None:
        content = orjson.dumps(body)
    return httpx.post(
        gw.url + CHAT, content=content, headers={"content-type": "application/json"}, timeout=30
    )


def error_of(response: httpx.Response) -> dict[str, Any]:
    body = response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]  # type: ignore[no-any-return]


def data_events(text: str) -> list[str]:
    return [e[len("data: ") :] for e in text.split("\n\n") if e.startswith("data: ")]


def first_pick(stack: Stack) -> ManagedProcess:
    """The worker least_inflight picks for a lone request: ties go to the smallest name."""
    return min(stack.emus, key=lambda e: f"127.0.0.1:{e.port}")


def faults(stack: Stack, emu: ManagedProcess, **values: Any) -> None:
    stack.control(emu, "/emulator/faults", values)


@pytest.mark.parametrize(
    ("content", "param"),
    [
        (b"{not json", None),
        (b'{"model": "moonshotai/Kimi-K2.5"}', "messages"),
        (b'{"messages": [{"role": "user", "content": "x"}]}', "model"),
        (b'{"model": "moonshotai/Kimi-K2.5", "messages": "hi"}', "messages"),
        (b'{"model": "moonshotai/Kimi-K2.5", "messages": [{}], "stream": 1}', "stream"),
    ],
)
def test_invalid_request_is_400(fresh: Stack, content: bytes, param: str | None) -> None:
    response = post(fresh.gw, content=content)
    assert response.status_code == 400
    assert error_of(response)["param"] == param
    assert response.headers["x-request-id"]


def test_unknown_model_is_404(fresh: Stack) -> None:
    response = post(fresh.gw, chat(model="gpt-nope"))
    assert response.status_code == 404
    assert error_of(response)["code"] == "model_not_found"


def test_worker_4xx_is_rewrapped_with_its_status(fresh: Stack) -> None:
    for emu in fresh.emus:
        faults(fresh, emu, fail_status=400)
    response = post(fresh.gw, chat())
    assert response.status_code == 400
    err = error_of(response)
    assert err["message"]
    assert err["type"] == "invalid_request_error"


def test_all_workers_overloaded_is_503_with_retry_after(fresh: Stack) -> None:
    for emu in fresh.emus:
        faults(fresh, emu, fail_status=503)
    response = post(fresh.gw, chat(stream=True))
    assert response.status_code == 503
    assert int(response.headers["retry-after"]) >= 1
    direct = httpx.post(fresh.emus[0].url + CHAT, json=chat(), timeout=30)
    assert error_of(response)["message"] == direct.json()["message"]  # SGLang-shaped there


def test_worker_dying_mid_stream_gives_an_error_event_then_done(fresh: Stack) -> None:
    for emu in fresh.emus:
        faults(fresh, emu, die_after_chunks=3)
    response = post(fresh.gw, chat(stream=True))
    assert response.status_code == 200
    events = data_events(response.text)
    assert events[-1] == "[DONE]"
    assert orjson.loads(events[-2])["error"]["code"] == "stream_interrupted"
    # Three events from the first worker, two more from the other continuing the stream (its
    # role chunk is not relayed: app.proxy.continuation), which breaks too; then the error, [DONE].
    assert len(events) == 3 + 2 + 2
    assert all("error" not in orjson.loads(e) for e in events[:5])


@pytest.mark.parametrize(
    "fault",
    [{"fail_status": 503}, {"die_after_chunks": 0}, {"inband_error_after_chunks": 0}],
    ids=["status-503", "dies-before-first-event", "inband-error-first"],
)
def test_failure_before_commit_is_retried_on_the_other_worker(
    fresh: Stack, fault: dict[str, Any]
) -> None:
    bad = first_pick(fresh)
    good = next(e for e in fresh.emus if e is not bad)
    before = fresh.stats(good)["totals"]["finished"]
    faults(fresh, bad, **fault)
    response = post(fresh.gw, chat(stream=True))
    assert response.status_code == 200
    events = data_events(response.text)
    assert events[-1] == "[DONE]"
    assert all("error" not in orjson.loads(e) for e in events[:-1])
    assert fresh.stats(bad)["totals"]["requests"] >= 1
    assert fresh.stats(good)["totals"]["finished"] == before + 1
    metrics = httpx.get(fresh.gw.url + "/metrics", timeout=5).text
    assert "dflash_gateway_retries_total{reason=" in metrics


def test_dead_worker_is_retried_on_the_other(procs: ProcessManager) -> None:
    a, b = emulator(procs, "emu-a"), emulator(procs, "emu-b")
    # Slow health checks: the gateway still believes the killed worker is healthy.
    # least_inflight: a lone request goes to the first worker by name, the one killed.
    env = {"DFLASH_GATEWAY_HEALTH__INTERVAL_S": "600", "DFLASH_GATEWAY_POLICY": "least_inflight"}
    gw = gateway(procs, [a, b], env=env)
    dead = min((a, b), key=lambda e: f"127.0.0.1:{e.port}")
    alive = b if dead is a else a
    dead.kill()
    response = post(gw, chat(stream=True))
    assert response.status_code == 200
    assert data_events(response.text)[-1] == "[DONE]"
    assert b"error" not in response.content
    stats = httpx.get(alive.url + "/emulator/stats", timeout=5).json()
    assert stats["totals"]["finished"] == 1
    attempts = httpx.get(gw.url + "/metrics", timeout=5).text
    assert f'outcome="connect_error",worker="127.0.0.1:{dead.port}"}} 1.0' in attempts


def test_no_healthy_worker_is_503_with_retry_after(fresh: Stack) -> None:
    for emu in fresh.emus:
        faults(fresh, emu, unhealthy=True)
    poll(lambda: httpx.get(fresh.gw.url + "/readyz", timeout=5).status_code == 503, timeout=10)
    response = post(fresh.gw, chat())
    assert response.status_code == 503
    assert response.headers["retry-after"]
    assert error_of(response)["code"] == "service_unavailable"
    for emu in fresh.emus:
        faults(fresh, emu, clear=True)
    poll(lambda: httpx.get(fresh.gw.url + "/readyz", timeout=5).status_code == 200, timeout=10)


def test_starting_worker_gets_no_traffic(procs: ProcessManager) -> None:
    emu = procs.start([*EMULATE, "--unhealthy"], name="emu", ready_path="/health", ready_status=503)
    gw = gateway(procs, [emu], ready=False)
    assert httpx.get(gw.url + "/readyz", timeout=5).status_code == 503
    response = post(gw, chat())
    assert response.status_code == 503
    assert response.headers["retry-after"]
    assert httpx.get(emu.url + "/emulator/stats", timeout=5).json()["totals"]["requests"] == 0


def test_upstream_timeout_is_504_and_the_attempt_is_aborted(procs: ProcessManager) -> None:
    emu = emulator(procs, "emu", "--hang-before-first-byte")
    env = {"DFLASH_GATEWAY_TIMEOUTS__FIRST_BYTE_S": "1"}
    gw = gateway(procs, [emu], env=env)
    response = post(gw, chat(stream=True))
    assert response.status_code == 504
    assert error_of(response)["code"] == "upstream_timeout"

    def aborted() -> bool:
        stats = httpx.get(emu.url + "/emulator/stats", timeout=5).json()
        return any(r["aborted"] == "abort" for r in stats["requests"])

    poll(aborted, timeout=5)


def test_body_over_the_limit_is_413(procs: ProcessManager) -> None:
    emu = emulator(procs, "emu")
    gw = gateway(procs, [emu], env={"DFLASH_GATEWAY_LIMITS__MAX_BODY_BYTES": "2048"})
    response = post(gw, chat(messages=[{"role": "user", "content": "x" * 4096}]))
    assert response.status_code == 413
    assert error_of(response)["code"] == "payload_too_large"
