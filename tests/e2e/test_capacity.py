"""Capacity with real processes: each worker admitted to the running cap it reports, and
``spare_capacity`` sending more of the traffic to the faster of two workers."""

from __future__ import annotations

import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from tests.e2e.conftest import emulator, gateway, poll
from tests.support.procs import ManagedProcess, ProcessManager

CHAT = "/v1/chat/completions"


def _body(content: str, stream: bool = True, max_tokens: int = 24) -> dict[str, Any]:
    return {
        "model": "kimi-k2.5",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "stream": stream,
        "chat_template_kwargs": {"thinking": False},
    }


def _workers(gw: ManagedProcess) -> dict[str, dict[str, Any]]:
    return {w["url"]: w for w in httpx.get(gw.url + "/workers", timeout=5).json()["workers"]}


def _active(emu: ManagedProcess) -> int:
    return len(httpx.get(emu.url + "/emulator/stats", timeout=5).json()["active"])


def _requests(emu: ManagedProcess) -> int:
    stats = httpx.get(emu.url + "/emulator/stats", params={"limit": 0}, timeout=5).json()
    return int(stats["totals"]["requests"])


def _gate(emu: ManagedProcess, body: dict[str, Any]) -> None:
    httpx.post(emu.url + "/emulator/gate", json=body, timeout=5).raise_for_status()


def test_each_worker_is_admitted_to_its_own_running_cap(procs: ProcessManager) -> None:
    small = emulator(procs, "emu-small", "--max-running-requests", "2")
    large = emulator(procs, "emu-large", "--max-running-requests", "6")
    gw = gateway(procs, [small, large], env={"DFLASH_GATEWAY_ADMISSION__QUEUE_TIMEOUT_S": "60"})
    learned = _workers(gw)
    assert learned[small.url]["capacity"]["admission_cap"] == 2
    assert learned[large.url]["capacity"]["admission_cap"] == 6
    assert learned[large.url]["capacity"]["max_running_requests"] == 6
    assert learned[large.url]["capacity"]["context_length"] > 0
    for emu in (small, large):
        _gate(emu, {"hold_after_chunks": 1})
    results: list[int] = []

    def stream(i: int) -> None:
        body = _body(f"Question {i}: what is {i} * 7?")
        with httpx.stream("POST", gw.url + CHAT, json=body, timeout=60) as response:
            response.read()
            results.append(response.status_code)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(10)]
    for thread in threads:
        thread.start()
    try:
        # 2 + 6 streams held on the workers; the other 2 wait in the gateway's queue, not on a
        # worker that is already at its limit.
        poll(lambda: _active(small) + _active(large) == 8, timeout=15)
        poll(lambda: httpx.get(gw.url + "/workers", timeout=5).json()["queued"] == 2, timeout=15)
        assert (_active(small), _active(large)) == (2, 6)
    finally:
        for emu in (small, large):
            _gate(emu, {"release": True})
        for thread in threads:
            thread.join(timeout=60)
    assert results == [200] * 10


def test_spare_capacity_sends_more_traffic_to_the_faster_worker(procs: ProcessManager) -> None:
    # Slow enough that a request spans loads polls; the gateway averages a rate once a worker has
    # been busy for a few polls (its gen_throughput is a trailing window).
    fast = emulator(procs, "emu-fast", "--speed", "4")
    slow = emulator(procs, "emu-slow", "--speed", "4", "--step-time-scale", "4")
    gw = gateway(
        procs,
        [fast, slow],
        env={
            "DFLASH_GATEWAY_POLICY": "spare_capacity",
            "DFLASH_GATEWAY_HEALTH__LOADS_INTERVAL_S": "0.5",
        },
    )
    poll(lambda: all(w["routable"] for w in _workers(gw).values()))

    def client(c: int, n: int = 6, max_tokens: int = 128) -> list[int]:
        with httpx.Client(base_url=gw.url, timeout=60) as http:
            return [
                http.post(
                    CHAT, json=_body(f"Client {c} asks {i}: 3 + {i}?", False, max_tokens)
                ).status_code
                for i in range(n)
            ]

    def measured() -> bool:
        # Sustained load on both until the gateway has averaged a rate for each.
        with ThreadPoolExecutor(max_workers=8) as pool:
            list(pool.map(client, range(90, 98), [4] * 8, [512] * 8))
        return all(w["load"]["per_request_rate"] for w in _workers(gw).values())

    poll(measured, timeout=60, interval=0)
    before = _requests(fast), _requests(slow)
    with ThreadPoolExecutor(max_workers=8) as pool:
        statuses = Counter(s for batch in pool.map(client, range(8)) for s in batch)
    assert statuses == Counter({200: 48})
    # The slow node gives a running request a quarter of the tokens per second: it gets a
    # clearly smaller share of the next requests.
    to_fast, to_slow = _requests(fast) - before[0], _requests(slow) - before[1]
    assert to_fast > 2 * to_slow, (to_fast, to_slow)
