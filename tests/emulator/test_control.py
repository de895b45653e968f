"""Abort by rid prefix, faults, the gate and ground truth on a running emulator."""

from __future__ import annotations

import threading
from typing import Any

import httpx
import pytest

from tests.emulator.support import CHAT, events, record, stats, wait_for
from tests.support.procs import ManagedProcess

LONG = {**CHAT, "max_tokens": 100000, "ignore_eos": True, "stream": True}


def _collect(url: str, body: dict[str, Any], out: list[Any]) -> None:
    with (
        httpx.Client(base_url=url, timeout=30) as client,
        client.stream("POST", "/v1/chat/completions", json=body) as response,
    ):
        out.extend(events(response))


def test_abort_by_rid_prefix_ends_stream_with_abort(emu: ManagedProcess) -> None:
    with httpx.Client(base_url=emu.url, timeout=30) as client:
        client.post("/emulator/gate", json={"hold_after_chunks": 3})
        results: dict[str, list[Any]] = {"aaaa1111": [], "aaaa2222": [], "bbbb3333": []}
        threads = [
            threading.Thread(target=_collect, args=(emu.url, {**LONG, "rid": rid}, out))
            for rid, out in results.items()
        ]
        for t in threads:
            t.start()
        wait_for(lambda: client.get("/emulator/gate").json()["held"] == 3, what="3 held")
        assert client.post("/abort_request", json={"rid": "aaaa"}).status_code == 200
        for rid in ("aaaa1111", "aaaa2222"):
            assert record(client, rid)["aborted"] == "abort"
        assert "bbbb3333" in stats(client)["active"]
        client.post("/abort_request", json={"rid": "bbbb3333"})
        for t in threads:
            t.join(30)
    for out in results.values():
        assert out[-1] == "[DONE]"
        assert out[-2]["choices"][0]["finish_reason"] == "abort"


def test_empty_rid_aborts_nothing(emu: ManagedProcess) -> None:
    with httpx.Client(base_url=emu.url, timeout=30) as client:
        client.post("/emulator/gate", json={"hold_after_chunks": 2})
        out: list[Any] = []
        t = threading.Thread(target=_collect, args=(emu.url, {**LONG, "rid": "keep-me"}, out))
        t.start()
        wait_for(lambda: client.get("/emulator/gate").json()["held"] == 1, what="held")
        client.post("/abort_request", json={"rid": ""})
        assert stats(client)["active"] == ["keep-me"]
        client.post("/abort_request", json={"rid": "", "abort_all": True})
        t.join(30)
    assert out[-2]["choices"][0]["finish_reason"] == "abort"


def test_gate_holds_after_k_chunks_until_released(emu: ManagedProcess) -> None:
    with httpx.Client(base_url=emu.url, timeout=30) as client:
        client.post("/emulator/gate", json={"hold_after_chunks": 2})
        body = {**CHAT, "stream": True, "max_tokens": 30}
        with client.stream("POST", "/v1/chat/completions", json=body) as response:
            lines = response.iter_lines()
            got = [next(lines) for _ in range(4)]  # two events, each followed by a blank line
            assert [bool(x) for x in got] == [True, False, True, False]
            assert client.get("/emulator/gate").json() == {"hold_after_chunks": 2, "held": 1}
            client.post("/emulator/gate", json={"release": True})
            rest = list(events(lines))
        assert rest[-1] == "[DONE]"


@pytest.mark.parametrize("stream", [True, False])
def test_fail_status_fault(emu: ManagedProcess, stream: bool) -> None:
    with httpx.Client(base_url=emu.url, timeout=30) as client:
        client.post("/emulator/faults", json={"fail_status": 500, "fail_ratio": 1.0})
        response = client.post("/v1/chat/completions", json={**CHAT, "stream": stream})
        assert response.status_code == 500
        assert response.json()["object"] == "error"
        client.post("/emulator/faults", json={"fail_ratio": 0.0})
        assert client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 3}).is_success
        assert stats(client)["totals"]["failed"] == 1


def test_fault_validation(emu: ManagedProcess) -> None:
    with httpx.Client(base_url=emu.url, timeout=30) as client:
        assert client.post("/emulator/faults", json={"fail_ratio": 2}).status_code == 400
        assert client.post("/emulator/faults", json={"nope": 1}).status_code == 400
        assert client.post("/emulator/gate", json={}).status_code == 400


def test_die_fault_non_stream_drops_connection(emu: ManagedProcess) -> None:
    with httpx.Client(base_url=emu.url, timeout=30) as client:
        client.post("/emulator/faults", json={"die_after_chunks": 0})
        with pytest.raises(httpx.RemoteProtocolError):
            client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 5})
        client.post("/emulator/faults", json={"die_after_chunks": None})
        assert client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 5}).is_success


def test_die_after_chunks_drops_connection(emu: ManagedProcess) -> None:
    with httpx.Client(base_url=emu.url, timeout=30) as client:
        client.post("/emulator/faults", json={"die_after_chunks": 3})
        got: list[Any] = []
        with (
            pytest.raises(httpx.RemoteProtocolError),
            client.stream("POST", "/v1/chat/completions", json={**LONG, "rid": "dies"}) as r,
        ):
            got.extend(events(r))
        assert len(got) == 3 and "[DONE]" not in got
        assert record(client, "dies")["error"] == "die_after_chunks"
        client.post("/emulator/faults", json={"clear": True})
        assert client.get("/health").status_code == 200


def test_inband_error_after_chunks(emu: ManagedProcess) -> None:
    with httpx.Client(base_url=emu.url, timeout=30) as client:
        client.post("/emulator/faults", json={"inband_error_after_chunks": 2})
        with client.stream("POST", "/v1/chat/completions", json=LONG) as response:
            assert response.status_code == 200
            got = list(events(response))
        assert len(got) == 4
        assert got[2] == {
            "error": {
                "object": "error",
                "message": "The request was aborted by the worker.",
                "type": "SERVICE_UNAVAILABLE",
                "param": None,
                "code": 503,
            }
        }
        assert got[3] == "[DONE]"


def test_faults_at_zero_chunks_act_before_any_event(emu: ManagedProcess) -> None:
    with httpx.Client(base_url=emu.url, timeout=30) as client:
        client.post("/emulator/faults", json={"inband_error_after_chunks": 0})
        with client.stream("POST", "/v1/chat/completions", json=LONG) as response:
            got = list(events(response))
        assert [type(g) for g in got] == [dict, str] and got[0]["error"]["code"] == 503
        client.post("/emulator/faults", json={"clear": True, "die_after_chunks": 0})
        with (
            pytest.raises(httpx.RemoteProtocolError),
            client.stream("POST", "/v1/chat/completions", json=LONG) as response,
        ):
            list(events(response))


def test_hang_before_first_byte_until_cleared(emu: ManagedProcess) -> None:
    with httpx.Client(base_url=emu.url, timeout=30) as client:
        client.post("/emulator/faults", json={"hang_before_first_byte": True})
        out: list[Any] = []
        body = {**CHAT, "stream": True, "max_tokens": 5, "rid": "hung"}
        t = threading.Thread(target=_collect, args=(emu.url, body, out))
        t.start()
        wait_for(lambda: "hung" in stats(client)["active"], what="request arrives")
        with pytest.raises(httpx.ReadTimeout):
            client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 1}, timeout=0.3)
        assert out == []
        client.post("/emulator/faults", json={"hang_before_first_byte": False})
        t.join(30)
    assert out[-1] == "[DONE]"


def test_unhealthy_fault(emu: ManagedProcess) -> None:
    with httpx.Client(base_url=emu.url, timeout=30) as client:
        client.post("/emulator/faults", json={"unhealthy": True})
        assert client.get("/health").status_code == 503
        assert client.get("/health_generate").status_code == 503
        client.post("/emulator/faults", json={"unhealthy": False})
        response = client.get("/health")
        assert response.status_code == 200 and response.content == b""


def test_first_byte_delay_is_applied(emu: ManagedProcess) -> None:
    with httpx.Client(base_url=emu.url, timeout=30) as client:
        client.post("/emulator/faults", json={"first_byte_delay_s": 5})
        with pytest.raises(httpx.ReadTimeout):
            client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 1}, timeout=0.5)
        client.post("/emulator/faults", json={"first_byte_delay_s": 0})
        assert client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 1}).is_success


def test_stats_filters(emu: ManagedProcess) -> None:
    with httpx.Client(base_url=emu.url, timeout=30) as client:
        for rid in ("flt-a1", "flt-a2", "flt-b1"):
            client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 2, "rid": rid})
        assert [r["rid"] for r in stats(client, rid="flt-a")["requests"]] == ["flt-a1", "flt-a2"]
        assert [r["rid"] for r in stats(client, limit=1)["requests"]] == ["flt-b1"]
        assert stats(client, limit=0)["requests"] == []
        assert stats(client)["totals"]["finished"] == 3


def test_stats_record_fields(emu: ManagedProcess) -> None:
    with httpx.Client(base_url=emu.url, timeout=30) as client:
        client.post(
            "/v1/chat/completions",
            json={**CHAT, "max_tokens": 20, "rid": "rec-1"},
            headers={"X-Emulator-Profile": "math500"},
        )
        rec = record(client, "rec-1")
    assert rec["profile"] == "math500"
    assert rec["steps"] == len(rec["tokens_per_step"])
    assert rec["spec_accept_length"] == 20 / rec["steps"]
    assert rec["aborted"] is None and rec["finish_reason"] == "length"
    assert rec["started"] <= rec["first_token"] <= rec["finished"]


def _accept(client: httpx.Client, n: int, stream: bool) -> list[float]:
    """Per-request acceptance of ``n`` mtbench requests: ``meta_info``, or for streams the
    completion tokens per chunk with output (one chunk per verify step)."""
    body = {**CHAT, "max_tokens": 200, "ignore_eos": True, "stream": stream}
    body |= {"stream_options": {"include_usage": True}, "return_meta_info": True}
    headers = {"X-Emulator-Profile": "mtbench"}
    lengths: list[float] = []
    for i in range(n):
        request = {**body, "seed": i, "temperature": 0.5}
        if not stream:
            response = client.post("/v1/chat/completions", json=request, headers=headers)
            lengths.append(response.json()["choices"][0]["meta_info"]["spec_accept_length"])
            continue
        with client.stream(
            "POST", "/v1/chat/completions", json=request, headers=headers
        ) as response:
            got = [e for e in events(response) if e != "[DONE]"]
        deltas = [e["choices"][0]["delta"] for e in got if e["choices"]]
        chunks = [d for d in deltas if d.get("content") or d.get("reasoning_content")]
        lengths.append(got[-1]["usage"]["completion_tokens"] / len(chunks))
    return lengths


@pytest.mark.parametrize("stream", [False, True])
def test_accept_collapse_fault_lowers_acceptance_everywhere(
    emu: ManagedProcess, stream: bool
) -> None:
    with httpx.Client(base_url=emu.url, timeout=30) as client:
        normal = _accept(client, 4, stream)
        assert client.post("/emulator/faults", json={"accept_collapse": True}).json()[
            "accept_collapse"
        ] == pytest.approx(1.3)
        client.delete("/emulator/stats")
        collapsed = _accept(client, 4, stream)
        loads = client.get("/v1/loads", params={"include": "core,spec"}).json()
        client.post("/emulator/faults", json={"accept_collapse": None})
        recovered = _accept(client, 4, stream)
    assert min(normal) > 2.5 and min(recovered) > 2.5
    assert max(collapsed) < 2.0
    assert 1.0 < sum(collapsed) / len(collapsed) < 1.7
    # The worker's cumulative figure falls too (it includes the normal requests before).
    assert loads["loads"][0]["speculative"]["accept_length"] < sum(normal) / len(normal)


def test_accept_collapse_fault_validation(emu: ManagedProcess) -> None:
    with httpx.Client(base_url=emu.url, timeout=30) as client:
        for bad in (0.5, 9, "low", False):
            response = client.post("/emulator/faults", json={"accept_collapse": bad})
            assert response.status_code == 400, bad
        assert client.post("/emulator/faults", json={"accept_collapse": 2}).status_code == 200
        assert client.get("/emulator/faults").json()["accept_collapse"] == 2
