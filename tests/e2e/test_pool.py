"""The worker pool with three real emulated workers: eviction and readmission, the circuit
breaker, admission caps and the queue, prefix affinity, and the SIGTERM drain."""

from __future__ import annotations

import signal
import threading
from collections import Counter
from typing import Any

import httpx
import pytest

from tests.e2e.conftest import emulator, gateway, poll
from tests.support.procs import ManagedProcess, ProcessManager

CHAT = "/v1/chat/completions"


def _body(stream: bool = True, max_tokens: int = 24, **extra: Any) -> dict[str, Any]:
    return {
        "model": "kimi-k2.5",
        "messages": [{"role": "user", "content": "What is 17 * 23?"}],
        "max_tokens": max_tokens,
        "stream": stream,
        **extra,
    }


def _workers(gw: ManagedProcess) -> dict[str, dict[str, Any]]:
    table = httpx.get(gw.url + "/workers", timeout=5).json()["workers"]
    return {w["url"]: w for w in table}


def _stream(url: str, body: dict[str, Any], timeout: float = 60) -> tuple[int, bytes]:
    with httpx.stream("POST", url + CHAT, json=body, timeout=timeout) as response:
        return response.status_code, response.read()


def _active(emu: ManagedProcess) -> int:
    return len(httpx.get(emu.url + "/emulator/stats", timeout=5).json()["active"])


def _control(emu: ManagedProcess, path: str, body: dict[str, Any]) -> None:
    httpx.post(emu.url + path, json=body, timeout=5).raise_for_status()


@pytest.fixture
def three(procs: ProcessManager) -> list[ManagedProcess]:
    return [emulator(procs, f"emu{i}") for i in range(3)]


def test_killed_worker_is_evicted_and_readmitted_without_failing_requests(
    procs: ProcessManager, three: list[ManagedProcess]
) -> None:
    # least_inflight: the readmitted worker must get one of three streams held at once (the
    # default cache_aware keeps identical requests, one conversation, on one worker).
    env = {
        "DFLASH_GATEWAY_HEALTH__FAILURE_THRESHOLD": "2",
        "DFLASH_GATEWAY_POLICY": "least_inflight",
    }
    gw = gateway(procs, three, env=env)
    victim = three[1]
    poll(lambda: all(w["state"] == "healthy" for w in _workers(gw).values()))
    victim.kill()
    # Requests sent while the gateway has not noticed yet: a refused connection happens before
    # the commit point, so each one is retried on a live worker and none fails.
    statuses = [_stream(gw.url, _body())[0] for _ in range(12)]
    assert statuses == [200] * 12
    poll(lambda: _workers(gw)[victim.url]["state"] == "unhealthy", timeout=10)
    procs.restart(victim)
    # Healthy again, and its breaker (opened by the refused connections) has let a probe through.
    poll(lambda: _workers(gw)[victim.url]["routable"], timeout=30)
    # Readmitted: with every worker holding one stream, least_inflight must use it again.
    for emu in three:
        _control(emu, "/emulator/gate", {"hold_after_chunks": 1})
    threads = [threading.Thread(target=_stream, args=(gw.url, _body())) for _ in range(3)]
    try:
        for thread in threads:
            thread.start()
        poll(lambda: [_active(e) for e in three] == [1, 1, 1], timeout=15)
    finally:
        for emu in three:
            _control(emu, "/emulator/gate", {"release": True})
        for thread in threads:
            thread.join(timeout=30)


def test_breaker_opens_on_injected_500s_and_traffic_moves_away(
    procs: ProcessManager, three: list[ManagedProcess]
) -> None:
    gw = gateway(
        procs,
        three,
        env={
            "DFLASH_GATEWAY_POLICY": "round_robin",
            "DFLASH_GATEWAY_BREAKER__FAILURE_THRESHOLD": "3",
            "DFLASH_GATEWAY_BREAKER__OPEN_S": "60",
        },
    )
    bad = three[0]
    _control(bad, "/emulator/faults", {"fail_status": 500, "fail_ratio": 1.0})
    statuses = Counter(_stream(gw.url, _body(stream=False))[0] for _ in range(30))
    # 500 is not retried (it may have started work); once 3 reached the client the breaker
    # opened and the remaining requests went to the two healthy workers.
    assert statuses[500] == 3
    assert statuses[200] == 27
    assert _workers(gw)[bad.url]["breaker"] == "open"
    assert not _workers(gw)[bad.url]["routable"]


def test_worker_at_its_cap_gets_no_more_and_a_full_queue_is_503(
    procs: ProcessManager, three: list[ManagedProcess]
) -> None:
    gw = gateway(
        procs,
        three,
        env={
            "DFLASH_GATEWAY_ADMISSION__PER_WORKER_CAP": "2",
            "DFLASH_GATEWAY_ADMISSION__QUEUE_SIZE": "2",
            "DFLASH_GATEWAY_ADMISSION__QUEUE_TIMEOUT_S": "60",
        },
    )
    for emu in three:
        _control(emu, "/emulator/gate", {"hold_after_chunks": 1})
    results: list[int] = []
    threads = [
        threading.Thread(target=lambda: results.append(_stream(gw.url, _body())[0]))
        for _ in range(8)
    ]
    for thread in threads:
        thread.start()
    try:
        # 6 streams fill the three workers (cap 2 each); 2 more wait in the queue.
        poll(lambda: sum(_active(e) for e in three) == 6, timeout=15)
        poll(lambda: httpx.get(gw.url + "/workers", timeout=5).json()["queued"] == 2, timeout=15)
        assert [_active(e) for e in three] == [2, 2, 2]
        # The queue is full: refused at once, not after the 60 s queue timeout.
        refused = httpx.post(gw.url + CHAT, json=_body(stream=False), timeout=10)
        assert refused.status_code == 503
        assert refused.headers["Retry-After"].isdigit()
        assert refused.json()["error"]["type"] == "service_unavailable"
        assert [_active(e) for e in three] == [2, 2, 2]
    finally:
        for emu in three:
            _control(emu, "/emulator/gate", {"release": True})
        for thread in threads:
            thread.join(timeout=60)
    assert results == [200] * 8  # the queued ones were served once slots freed


def test_prefix_affinity_keeps_a_conversation_on_one_worker(
    procs: ProcessManager, three: list[ManagedProcess]
) -> None:
    gw = gateway(procs, three, env={"DFLASH_GATEWAY_POLICY": "prefix_affinity"})
    homes: dict[int, set[str]] = {}
    with httpx.Client(base_url=gw.url, timeout=30) as client:
        for conversation in range(12):
            messages = [
                {"role": "system", "content": "You are a careful math tutor."},
                {"role": "user", "content": f"Conversation {conversation}: what is 12 * 12?"},
            ]
            for _turn in range(3):
                body = {**_body(stream=False), "messages": messages}
                response = client.post(CHAT, json=body)
                assert response.status_code == 200
                rid = response.json()["id"]
                for emu in three:
                    if httpx.get(emu.url + "/emulator/stats", params={"rid": rid}).json()[
                        "requests"
                    ]:
                        homes.setdefault(conversation, set()).add(emu.url)
                reply = response.json()["choices"][0]["message"]["content"] or "ok"
                messages = [
                    *messages,
                    {"role": "assistant", "content": reply},
                    {"role": "user", "content": "And then?"},
                ]
    assert all(len(workers) == 1 for workers in homes.values()), homes
    spread = Counter(next(iter(w)) for w in homes.values())
    assert len(spread) >= 2  # conversations are spread over workers, not piled on one


def test_sigterm_drains_in_flight_streams_then_exits_0(
    procs: ProcessManager, three: list[ManagedProcess]
) -> None:
    gw = gateway(
        procs, three, env={"DFLASH_GATEWAY_DRAIN_ACCEPT_S": "1", "DFLASH_GATEWAY_DRAIN_S": "30"}
    )
    for emu in three:
        _control(emu, "/emulator/gate", {"hold_after_chunks": 2})
    result: list[tuple[int, bytes]] = []
    thread = threading.Thread(target=lambda: result.append(_stream(gw.url, _body())))
    thread.start()
    poll(lambda: sum(_active(e) for e in three) == 1, timeout=15)
    gw.signal(signal.SIGTERM)
    poll(lambda: httpx.get(gw.url + "/readyz", timeout=5).status_code == 503, timeout=5)
    for emu in three:
        _control(emu, "/emulator/gate", {"release": True})
    thread.join(timeout=30)
    status, raw = result[0]
    assert status == 200
    assert raw.rstrip().endswith(b"data: [DONE]")
    assert b'"error"' not in raw
    assert gw.popen is not None
    assert gw.popen.wait(timeout=30) == 0
