"""Acceptance collapse end to end: three emulated workers behind a real gateway, one of them
with the ``--accept-collapse`` fault (a drafter that no longer matches its target)."""

from __future__ import annotations

import re
import threading

import httpx
import pytest

from tests.e2e.conftest import emulator, gateway, poll
from tests.support.procs import ManagedProcess, ProcessManager

CHAT = {
    "model": "moonshotai/Kimi-K2.5",
    "messages": [{"role": "user", "content": "Tell me about gardens."}],
    "max_tokens": 48,
    "ignore_eos": True,
}


def _send(client: httpx.Client, n: int) -> None:
    for i in range(n):
        body = {**CHAT, "stream": i % 2 == 0, "seed": i, "temperature": 0.3}
        response = client.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text


def _requests(emu: ManagedProcess) -> int:
    stats = httpx.get(emu.url + "/emulator/stats", timeout=5).json()
    count: int = stats["totals"]["requests"]
    return count


@pytest.mark.parametrize("deweight", [False, True])
def test_the_collapsed_worker_is_flagged_and_with_deweighting_avoided(
    procs: ProcessManager, deweight: bool
) -> None:
    normal = [emulator(procs, f"emu-{i}", "--speed", "50", "--seed", "1") for i in range(2)]
    collapsed = emulator(procs, "emu-collapsed", "--speed", "50", "--accept-collapse")
    env = {
        "DFLASH_GATEWAY_POLICY": "round_robin",  # sequential requests spread over all three
        "DFLASH_GATEWAY_ROUTING__COLLAPSE_MIN_SAMPLES": "6",
        "DFLASH_GATEWAY_ROUTING__DEWEIGHT_COLLAPSED": str(deweight).lower(),
    }
    gw = gateway(procs, [*normal, collapsed], env=env)
    names = {emu.url.removeprefix("http://"): emu for emu in (*normal, collapsed)}
    bad = collapsed.url.removeprefix("http://")
    with httpx.Client(base_url=gw.url, timeout=30) as client:
        _send(client, 24)  # 8 each
        table = client.get("/workers").json()["workers"]
        flagged = {w["name"] for w in table if w["collapsed"]}
        assert flagged == {bad}
        by_name = {w["name"]: w for w in table}
        assert by_name[bad]["accept_length"] < 2.0
        assert all(by_name[n]["accept_length"] > 2.5 for n in names if n != bad)
        exposition = client.get("/metrics").text
        gauges = dict(
            re.findall(
                r'dflash_gateway_worker_accept_collapsed\{role="whole",worker="([^"]+)"\} (\S+)',
                exposition,
            )
        )
        assert gauges == {name: ("1.0" if name == bad else "0.0") for name in names}
        assert "dflash_gateway_fleet_saturation " in exposition

        before = {name: _requests(emu) for name, emu in names.items()}
        _send(client, 12)
        after = {name: _requests(emu) - before[name] for name, emu in names.items()}
    if deweight:
        assert after[bad] == 0
        assert all(after[n] == 6 for n in names if n != bad)
    else:
        assert after[bad] == 4


def test_fleet_saturation_counts_running_and_queued_requests(procs: ProcessManager) -> None:
    """Two workers capped at one request each by the gateway, three streams held open: two run,
    one waits in the admission queue: the fleet is saturated (1.0, the most the signal says)."""
    emus = [emulator(procs, f"emu-{i}", "--speed", "50") for i in range(2)]
    env = {"DFLASH_GATEWAY_ADMISSION__PER_WORKER_CAP": "1"}
    gw = gateway(procs, emus, env=env)
    for emu in emus:
        httpx.post(emu.url + "/emulator/gate", json={"hold_after_chunks": 1}, timeout=5)
    statuses: list[int] = []

    def stream() -> None:
        body = {**CHAT, "stream": True}
        with httpx.stream("POST", gw.url + "/v1/chat/completions", json=body, timeout=60) as r:
            r.read()
            statuses.append(r.status_code)

    threads = [threading.Thread(target=stream) for _ in range(3)]
    for t in threads:
        t.start()
    try:
        with httpx.Client(base_url=gw.url, timeout=5) as client:
            poll(lambda: client.get("/workers").json()["queued"] == 1, timeout=20)
            assert client.get("/workers").json()["saturation"] == 1.0  # every slot taken
            assert "dflash_gateway_fleet_saturation 1.0" in client.get("/metrics").text
    finally:
        for emu in emus:
            httpx.post(emu.url + "/emulator/gate", json={"release": True}, timeout=5)
        for t in threads:
            t.join(60)
    assert statuses == [200, 200, 200]
    with httpx.Client(base_url=gw.url, timeout=5) as client:
        # Idle again once the workers' polled load has caught up.
        poll(lambda: client.get("/workers").json()["saturation"] == 0.0, timeout=20)
