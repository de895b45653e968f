"""Prefill/decode disaggregation with real processes: emulated prefill and decode workers
(``emulate --disaggregation-mode prefill|decode``, which do SGLang 0.5.23's bootstrap handshake
and KV-transfer wait between them) behind ``serve --pd-disaggregation``. Clients (the OpenAI SDK,
curl, the Anthropic SDK) are served; both emulators' per-room records show every request used
exactly one room on one prefill and one decode worker; killing a worker mid-run leaves no request
hung and no decode waiting; the acceptance length the gateway records is the decode side's."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import anthropic
import httpx
import openai
import pytest

from loadtest.processes import free_port
from tests.e2e.conftest import EMULATE, FAST_HEALTH, poll
from tests.metrics.test_live import DASHBOARD, PD_ROW, _exprs, _row, missing_data
from tests.support.procs import PYTHON, ManagedProcess, ProcessManager, managed_processes
from tests.support.prometheus import start_prometheus
from tests.support.tools import require_tool

CHAT = "/v1/chat/completions"
# The emulators' own bootstrap and waiting timeouts: long enough that a decode side released
# within them was released by the gateway's abort, not by its own timeout.
SGLANG_TIMEOUTS = [
    "--disaggregation-bootstrap-timeout",
    "60",
    "--disaggregation-waiting-timeout",
    "60",
]


def prefill(procs: ProcessManager, name: str, *args: str) -> tuple[ManagedProcess, int]:
    port = free_port()
    emu = procs.start(
        [*EMULATE, "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port",
         str(port), *SGLANG_TIMEOUTS, *args],
        name=name, ready_path="/health", ready_status=200,
    )  # fmt: skip
    return emu, port


def decode(procs: ProcessManager, name: str, *args: str) -> ManagedProcess:
    return procs.start(
        [*EMULATE, "--disaggregation-mode", "decode", *SGLANG_TIMEOUTS, *args],
        name=name, ready_path="/health", ready_status=200,
    )  # fmt: skip


def pd_gateway(
    procs: ProcessManager,
    prefills: list[tuple[ManagedProcess, int]],
    decodes: list[ManagedProcess],
    env: dict[str, str] | None = None,
) -> ManagedProcess:
    argv = [PYTHON, "-m", "app", "serve", "--port", "{port}", "--pd-disaggregation"]
    for emu, port in prefills:
        argv += ["--prefill", emu.url, str(port)]
    for emu in decodes:
        argv += ["--decode", emu.url]
    return procs.start(
        argv,
        name="gateway",
        ready_path="/readyz",
        ready_status=200,
        env={**FAST_HEALTH, "DFLASH_GATEWAY_HEALTH__LOADS_INTERVAL_S": "0.3", **(env or {})},
    )


def stats(emu: ManagedProcess) -> dict[str, Any]:
    response = httpx.get(emu.url + "/emulator/stats", params={"limit": 0}, timeout=5)
    return response.json()  # type: ignore[no-any-return]


def records(emu: ManagedProcess) -> list[dict[str, Any]]:
    """The emulator's per-room records (all of them: no ``limit``)."""
    response = httpx.get(emu.url + "/emulator/stats", timeout=5)
    return response.json()["rooms"]["records"]  # type: ignore[no-any-return]


def body(i: int, *, stream: bool = True, max_tokens: int = 48) -> dict[str, Any]:
    return {
        "model": "kimi-k2.5",
        "messages": [{"role": "user", "content": f"Question {i}: explain step {i} briefly."}],
        "max_tokens": max_tokens,
        "stream": stream,
    }


def metric(text: str, name: str, **labels: str) -> float | None:
    inner = ",".join(f'{k}="{re.escape(v)}"' for k, v in sorted(labels.items()))
    found = re.search(rf"^dflash_gateway_{name}{{{inner}}} (\S+)$", text, re.M)
    return float(found.group(1)) if found else None


def served(text: str) -> float:
    """The requests the gateway has recorded as answered 200, all routes and models."""
    found = re.findall(
        r'^dflash_gateway_requests_total\{[^}]*status="200"[^}]*\} (\S+)$', text, re.M
    )
    return sum(float(value) for value in found)


def assert_one_room_each(ps: list[ManagedProcess], ds: list[ManagedProcess], served: int) -> None:
    """Every served request's room is on exactly one prefill and one decode worker, once each,
    with the same rid on both; ``served`` rooms in all."""
    prefill_rooms: dict[int, list[dict[str, Any]]] = {}
    decode_rooms: dict[int, list[dict[str, Any]]] = {}
    for emu in ps:
        for rec in records(emu):
            prefill_rooms.setdefault(rec["room"], []).append(rec)
    for emu in ds:
        for rec in records(emu):
            decode_rooms.setdefault(rec["room"], []).append(rec)
    done = {room: recs for room, recs in decode_rooms.items() if recs[0]["outcome"] == "served"}
    assert len(done) == served, (len(done), served)
    for room, recs in done.items():
        assert len(recs) == 1, recs
        assert len(prefill_rooms.get(room, [])) == 1, (room, prefill_rooms.get(room))
        (p_rec,) = prefill_rooms[room]
        assert p_rec["outcome"] == "transferred", p_rec
        assert p_rec["rid"] == recs[0]["rid"]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """2 prefill + 2 decode emulators behind one gateway in PD mode."""
    with managed_processes(tmp_path_factory, "pd") as manager:
        ps = [
            prefill(manager, "prefill-a", "--seed", "1"),
            prefill(manager, "prefill-b", "--seed", "2"),
        ]
        ds = [
            decode(manager, "decode-a", "--seed", "3"),
            decode(manager, "decode-b", "--seed", "4"),
        ]
        gw = pd_gateway(manager, ps, ds)
        table = lambda: httpx.get(gw.url + "/workers", timeout=5).json()["workers"]  # noqa: E731
        poll(lambda: all(w["state"] == "healthy" for w in table()), timeout=15)
        yield {"gw": gw, "ps": [p for p, _ in ps], "ds": ds, "ports": [port for _, port in ps]}


def test_sdk_curl_and_anthropic_stream_through_pairs_one_room_each(fleet: dict[str, Any]) -> None:
    gw, ps, ds = fleet["gw"], fleet["ps"], fleet["ds"]
    before = sum(1 for d in ds for r in records(d) if r["outcome"] == "served")
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0)
    claude = anthropic.Anthropic(base_url=gw.url, api_key="unused", max_retries=0)
    served = 0
    for i in range(4):
        chunks = list(client.chat.completions.create(**body(i)))  # type: ignore[call-overload]
        assert any(c.choices and c.choices[0].finish_reason for c in chunks)
        assert len(chunks) > 8  # D's decoded stream, not P's single token
        done = client.chat.completions.create(**body(i, stream=False))  # type: ignore[call-overload]
        assert done.usage is not None and done.usage.completion_tokens > 1
        with claude.messages.stream(
            model="kimi-k2.5",
            max_tokens=48,
            messages=[{"role": "user", "content": f"Tell me about {i}."}],
        ) as stream:
            final = stream.get_final_message()
        assert final.content and final.stop_reason in ("end_turn", "max_tokens")
        served += 3
    if shutil.which("curl"):
        raw = (
            '{"model": "kimi-k2.5", "stream": true, "max_tokens": 16, '
            '"messages": [{"role": "user", "content": "hi"}]}'
        )
        for _ in range(2):
            out = subprocess.run(
                ["curl", "-sN", gw.url + CHAT, "-H", "Content-Type: application/json", "-d", raw],
                capture_output=True, text=True, timeout=30, check=True,
            ).stdout  # fmt: skip
            assert out.rstrip().endswith("data: [DONE]")
            served += 1
    after = sum(1 for d in ds for r in records(d) if r["outcome"] == "served")
    assert after - before == served
    assert_one_room_each(ps, ds, after)
    # least_queued takes idle prefill workers in turn: both took part.
    assert all(records(p) for p in ps)
    table = {w["url"]: w for w in httpx.get(gw.url + "/workers", timeout=5).json()["workers"]}
    assert {table[p.url]["role"] for p in ps} == {"prefill"}
    assert {table[d.url]["role"] for d in ds} == {"decode"}
    assert sorted(table[p.url]["bootstrap_port"] for p in ps) == sorted(fleet["ports"])


def test_acceptance_length_comes_from_decode_and_matches_the_emulator(
    fleet: dict[str, Any],
) -> None:
    gw, ds = fleet["gw"], fleet["ds"]
    base = httpx.get(gw.url + "/metrics", timeout=5).text

    def counts(text: str, d: ManagedProcess) -> tuple[float, float]:
        name = d.url.removeprefix("http://")
        labels = {"model": "moonshotai/Kimi-K2.5", "worker": name}
        return (
            metric(text, "completion_tokens_total", **labels) or 0.0,
            metric(text, "spec_verify_steps_total", **labels) or 0.0,
        )

    truth_before = {d.url: stats(d)["totals"] for d in ds}
    with ThreadPoolExecutor(4) as pool:
        statuses = list(
            pool.map(
                lambda i: httpx.post(gw.url + CHAT, json=body(i, max_tokens=160), timeout=60),
                range(24),
            )
        )
    assert [r.status_code for r in statuses] == [200] * 24

    def settled() -> str | None:
        """/metrics once it shows the 24 requests (recorded as each response ends, which the
        client may see first) and the decode workers' transfer queues as read by a load poll
        after them (empty once idle): both are eventual, so they are waited for."""
        text = httpx.get(gw.url + "/metrics", timeout=5).text
        if served(text) < served(base) + 24:
            return None
        for d in ds:
            name = d.url.removeprefix("http://")
            queued = metric(text, "worker_kv_transfer_queue_requests", role="decode", worker=name)
            if queued != 0:
                return None
        return text

    text = poll(settled, timeout=20)
    for d in ds:
        tokens0, steps0 = counts(base, d)
        tokens1, steps1 = counts(text, d)
        if steps1 == steps0:
            continue
        measured = (tokens1 - tokens0) / (steps1 - steps0)
        after, before = stats(d)["totals"], truth_before[d.url]
        emitted = after["completion_tokens"] - before["completion_tokens"]
        steps = after["verify_steps"] - before["verify_steps"]
        truth = emitted / steps
        assert abs(measured - truth) <= 0.05 * truth, (d.name, measured, truth)
    for p in fleet["ps"]:  # no tokens are credited to a prefill worker
        name = p.url.removeprefix("http://")
        labels = {"model": "moonshotai/Kimi-K2.5", "worker": name}
        assert not metric(text, "spec_verify_steps_total", **labels)
    assert metric(text, "pd_kv_transfer_wait_seconds_count", model="moonshotai/Kimi-K2.5")
    for d in ds:  # the decode workers' own transfer queues are read (empty once idle)
        name = d.url.removeprefix("http://")
        assert metric(text, "worker_kv_transfer_queue_requests", role="decode", worker=name) == 0


@pytest.mark.parametrize("victim", ["prefill", "decode"])
def test_killing_a_worker_mid_run_leaves_nothing_hung(procs: ProcessManager, victim: str) -> None:
    """Concurrent streams while one prefill or one decode worker is killed: every request ends
    (answered, or an error event / status) well within its deadline, and the surviving decode
    workers have no room left waiting."""
    ps = [prefill(procs, "prefill-a", "--seed", "1"), prefill(procs, "prefill-b", "--seed", "2")]
    ds = [decode(procs, "decode-a", "--seed", "3"), decode(procs, "decode-b", "--seed", "4")]
    gw = pd_gateway(procs, ps, ds, env={"DFLASH_GATEWAY_TIMEOUTS__TOTAL_S": "40"})
    poll(
        lambda: all(
            w["state"] == "healthy"
            for w in httpx.get(gw.url + "/workers", timeout=5).json()["workers"]
        ),
        timeout=15,
    )
    target = ps[0][0] if victim == "prefill" else ds[0]

    def one(i: int) -> str:
        try:
            with httpx.stream(
                "POST", gw.url + CHAT, json=body(i, max_tokens=400), timeout=35
            ) as response:
                text = "".join(response.iter_text())
        except httpx.HTTPError as exc:  # the gateway never leaves a client hanging
            return f"transport:{type(exc).__name__}"
        if response.status_code != 200:
            return f"status:{response.status_code}"
        assert text.rstrip().endswith("data: [DONE]"), text[-300:]
        return "error" if '"error"' in text else "ok"

    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(one, i) for i in range(24)]
        poll(lambda: sum(f.done() for f in futures) >= 4, timeout=30)
        target.kill()
        results = [f.result(timeout=45) for f in futures]
    assert all(not r.startswith("transport") for r in results), results
    assert results.count("ok") >= 12, results  # the rest went to the surviving pair
    survivors = [d for d in ds if d is not target]
    for d in survivors:  # released by the gateway's aborts, well before the 60 s timeouts
        poll(lambda d=d: stats(d)["rooms"]["pending"] == [], timeout=10)
    table = httpx.get(gw.url + "/workers", timeout=5).json()["workers"]
    assert all(w["in_flight"] == 0 for w in table), table


def test_the_dashboards_pd_row_has_data(fleet: dict[str, Any], procs: ProcessManager) -> None:
    """A real Prometheus scraping the PD gateway: every query of the dashboard's PD row returns
    data (the whole-worker fleet of tests/metrics/test_live.py checks the other rows)."""
    require_tool("prometheus")
    gw = fleet["gw"]
    prom = start_prometheus(procs, {"dflash-gateway": [gw.url.removeprefix("http://")]})
    assert prom.wait_for('up{job="dflash-gateway"} == 1')
    with ThreadPoolExecutor(4) as pool:
        statuses = list(
            pool.map(lambda i: httpx.post(gw.url + CHAT, json=body(i), timeout=60), range(40))
        )
    assert [r.status_code for r in statuses] == [200] * 40
    assert prom.wait_for("rate(dflash_gateway_pd_kv_transfer_wait_seconds_count[1m]) > 0")
    board = json.loads(DASHBOARD.read_text())
    exprs = _exprs(_row(board, PD_ROW))
    assert len(exprs) >= 7
    assert missing_data(prom, exprs) == []
