"""Prefill/decode disaggregation: a real prefill and a real decode emulator on loopback, driven as
sglang-router drives a pair (the same body, with the bootstrap fields, to both at once)."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.emulator.support import CHAT, events, record, stats, wait_for
from tests.support.procs import (
    PYTHON,
    ManagedProcess,
    ProcessManager,
    free_port,
    managed_processes,
)

pytestmark = pytest.mark.processes

EMULATE = [PYTHON, "-m", "app", "emulate", "--port", "{port}", "--speed", "50", "--seed", "3"]
CHAT_PATH = "/v1/chat/completions"
# Far apart: a request with n choices uses rooms room .. room + n - 1.
_rooms = itertools.count(1 << 40, 1000)


@dataclass
class Pair:
    prefill: ManagedProcess
    decode: ManagedProcess
    bootstrap_port: int
    p: httpx.Client
    d: httpx.Client
    pool: ThreadPoolExecutor

    def body(self, rid: str, room: int | None = None, **extra: Any) -> dict[str, Any]:
        """A request as the router sends it to both sides."""
        return {
            **CHAT,
            "max_tokens": 40,
            "rid": rid,
            "bootstrap_host": "127.0.0.1",
            "bootstrap_port": self.bootstrap_port,
            "bootstrap_room": next(_rooms) if room is None else room,
            **extra,
        }

    def submit(self, client: httpx.Client, body: dict[str, Any]) -> Future[httpx.Response]:
        return self.pool.submit(client.post, CHAT_PATH, json=body)

    def submit_stream(self, client: httpx.Client, body: dict[str, Any]) -> Future[list[Any]]:
        def run() -> list[Any]:
            with client.stream("POST", CHAT_PATH, json={**body, "stream": True}) as response:
                return [response.status_code, *events(response)]

        return self.pool.submit(run)


@pytest.fixture(scope="module")
def pair_module(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    bootstrap_port = free_port()
    with managed_processes(tmp_path_factory, "pd") as procs:
        prefill = procs.start(
            [
                *EMULATE,
                "--disaggregation-mode",
                "prefill",
                "--disaggregation-bootstrap-port",
                str(bootstrap_port),
            ],
            name="prefill",
        )
        decode = procs.start(
            [
                *EMULATE,
                "--disaggregation-mode",
                "decode",
                # A bound for the test that never sends the prefill side, not a measurement.
                "--disaggregation-waiting-timeout",
                "2",
            ],
            name="decode",
        )
        with (
            httpx.Client(base_url=prefill.url, timeout=30) as p,
            httpx.Client(base_url=decode.url, timeout=30) as d,
            ThreadPoolExecutor(max_workers=8) as pool,
        ):
            yield Pair(prefill, decode, bootstrap_port, p, d, pool)


@pytest.fixture
def pair(pair_module: Pair) -> Iterator[Pair]:
    yield pair_module
    for client in (pair_module.p, pair_module.d):
        client.delete("/emulator/stats")


def _rooms_of(client: httpx.Client) -> dict[str, Any]:
    rooms: dict[str, Any] = stats(client)["rooms"]
    return rooms


def _room_record(client: httpx.Client, room: int) -> dict[str, Any]:
    found: dict[str, Any] = wait_for(
        lambda: next((r for r in _rooms_of(client)["records"] if r["room"] == room), None),
        what=f"room {room}",
    )
    return found


def _metric(client: httpx.Client, name: str) -> tuple[float, dict[str, str]]:
    """A single-series metric of the worker's ``/metrics``: (value, labels)."""
    for family in text_string_to_metric_families(client.get("/metrics").text):
        for sample in family.samples:
            if sample.name == name:
                return sample.value, sample.labels
    raise AssertionError(f"{name} not in /metrics")


def _pending(client: httpx.Client, pick: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
    found: dict[str, Any] = wait_for(
        lambda: next((r for r in _rooms_of(client)["pending"] if pick(r)), None),
        what="a pending room",
    )
    return found


def test_pair_answers_through_decode_non_stream(pair: Pair) -> None:
    body = pair.body("pd-plain")
    from_p = pair.submit(pair.p, body)
    from_d = pair.submit(pair.d, body)
    d_answer, p_answer = from_d.result(), from_p.result()
    assert d_answer.status_code == 200, d_answer.text
    assert p_answer.status_code == 200, p_answer.text
    # The prefill server answers with the one token its prefill sampled, finish "length".
    p_json = p_answer.json()
    assert p_json["usage"]["completion_tokens"] == 1
    assert p_json["choices"][0]["finish_reason"] == "length"
    d_json = d_answer.json()
    assert d_json["id"] == "pd-plain"
    assert d_json["usage"]["completion_tokens"] == 40
    assert d_json["choices"][0]["finish_reason"] == "length"
    # Both sampled the same text: P's token is where D's answer starts.
    p_text = p_json["choices"][0]["message"]["reasoning_content"]
    assert d_json["choices"][0]["message"]["reasoning_content"].startswith(p_text)

    room = body["bootstrap_room"]
    p_room = _room_record(pair.p, room)
    d_room = _room_record(pair.d, room)
    assert (p_room["role"], p_room["outcome"], p_room["rid"]) == (
        "prefill",
        "transferred",
        "pd-plain",
    )
    assert p_room["decode"] == f"127.0.0.1:{pair.decode.port}"
    assert (d_room["role"], d_room["outcome"], d_room["rid"]) == ("decode", "served", "pd-plain")
    assert d_room["prefill"] == f"127.0.0.1:{pair.bootstrap_port}"
    # DFLASH runs on the decode side only: verify steps there, none on the prefill server.
    d_req = record(pair.d, "pd-plain")
    p_req = record(pair.p, "pd-plain")
    assert d_req["steps"] > 0 and sum(d_req["tokens_per_step"]) == 40
    assert d_req["spec_accept_length"] == pytest.approx(40 / d_req["steps"])
    assert d_req["bootstrap_room"] == room and d_req["prefill_s"] == 0
    assert p_req["steps"] == 0 and p_req["prefill_s"] > 0
    assert d_room["transferred"] >= p_room["transferred"]


def test_pair_answers_through_decode_streamed(pair: Pair) -> None:
    body = pair.body("pd-stream", stream_options={"include_usage": True})
    from_p = pair.submit_stream(pair.p, body)
    from_d = pair.submit_stream(pair.d, body)
    d_events, p_events = from_d.result(), from_p.result()
    assert d_events[0] == 200 and p_events[0] == 200
    assert d_events[-1] == "[DONE]" and p_events[-1] == "[DONE]"
    d_usage = d_events[-2]["usage"]
    assert d_usage["completion_tokens"] == 40
    assert p_events[-2]["usage"]["completion_tokens"] == 1
    finishes = [e["choices"][0]["finish_reason"] for e in d_events[1:-2] if e["choices"]]
    assert finishes[-1] == "length"
    room = body["bootstrap_room"]
    assert _room_record(pair.p, room)["outcome"] == "transferred"
    assert _room_record(pair.d, room)["outcome"] == "served"
    assert record(pair.d, "pd-stream")["chunks_sent"] > 2


def test_each_choice_uses_its_own_room(pair: Pair) -> None:
    """``n`` choices get rooms ``room + index`` on both sides (SGLang's
    ``_normalize_bootstrap_params``)."""
    body = pair.body("pd-n", n=2, temperature=0.7, max_tokens=8)
    from_p = pair.submit(pair.p, body)
    from_d = pair.submit(pair.d, body)
    assert from_d.result().status_code == 200, from_d.result().text
    assert from_p.result().status_code == 200, from_p.result().text
    room = body["bootstrap_room"]
    for client, outcome in ((pair.p, "transferred"), (pair.d, "served")):
        assert _room_record(client, room)["outcome"] == outcome
        assert _room_record(client, room + 1)["outcome"] == outcome


def test_decode_waits_for_the_prefill_side(pair: Pair) -> None:
    body = pair.body("pd-wait")
    room = body["bootstrap_room"]
    from_d = pair.submit(pair.d, {**body, "max_tokens": 5})
    waiting = _pending(pair.d, lambda r: r["room"] == room and r["status"] == "WaitingForInput")
    assert waiting["rid"] == "pd-wait"
    # P holds D's destination for the room, with no prefill request yet.
    on_p = _pending(pair.p, lambda r: r["room"] == room and r["status"] == "WaitingForInput")
    assert on_p["rid"] is None
    assert on_p["decode"] == f"127.0.0.1:{pair.decode.port}"
    assert not from_d.done()
    assert _metric(pair.d, "sglang:num_decode_transfer_queue_reqs")[0] == 1
    assert "pd-wait" in stats(pair.d)["active"]
    assert not stats(pair.d, rid="pd-wait")["requests"]

    p_answer = pair.submit(pair.p, body).result()
    d_answer = from_d.result()
    assert p_answer.status_code == 200 and d_answer.status_code == 200
    p_room = _room_record(pair.p, room)
    d_req = record(pair.d, "pd-wait")
    assert d_req["first_token"] >= p_room["transferred"]
    assert _rooms_of(pair.p)["pending"] == [] and _rooms_of(pair.d)["pending"] == []


def test_decode_times_out_when_prefill_never_gets_the_request(pair: Pair) -> None:
    body = pair.body("pd-lonely")
    room = body["bootstrap_room"]
    answer = pair.d.post(CHAT_PATH, json=body)
    assert answer.status_code == 500
    message = (
        f"Decode transfer failed for request rank=0 decode_req.req.rid='pd-lonely' "
        f"decode_req.req.bootstrap_room={room} with exception KVTransferError(bootstrap_room="
        f"{room}): Request {room} timed out after 2.0s in KVPoll.WaitingForInput"
    )
    assert answer.json() == {
        "object": "error",
        "message": message,
        "type": "500",
        "param": None,
        "code": 500,
    }
    assert _room_record(pair.d, room)["outcome"] == "timeout"
    assert _metric(pair.d, "sglang:num_transfer_failed_reqs_total")[0] >= 1
    # D dropped the room on P too: a late prefill request for it fails at once.
    assert _rooms_of(pair.p)["pending"] == []
    late = pair.p.post(CHAT_PATH, json=body)
    assert late.status_code == 500
    assert late.json()["message"].startswith(
        f"Prefill bootstrap failed for request rank=0 req.rid='pd-lonely' req.bootstrap_room={room}"
    )
    assert late.json()["message"].endswith("Aborted by AbortReq.")


def test_decode_timeout_streamed_is_an_in_band_error(pair: Pair) -> None:
    body = pair.body("pd-lonely-stream")
    got = pair.submit_stream(pair.d, body).result()
    assert got[0] == 200 and got[-1] == "[DONE]" and len(got) == 3
    error = got[1]["error"]
    assert (error["type"], error["code"]) == ("INTERNAL_SERVER_ERROR", 500)
    assert "in KVPoll.WaitingForInput" in error["message"]


def test_abort_on_decode_drops_the_room_on_both_sides(pair: Pair) -> None:
    body = pair.body("pd-abort-d")
    room = body["bootstrap_room"]
    from_d = pair.submit(pair.d, body)
    _pending(pair.p, lambda r: r["room"] == room)
    assert pair.d.post("/abort_request", json={"rid": "pd-abort-d"}).status_code == 200
    answer = from_d.result()
    assert answer.status_code == 200
    assert answer.json()["choices"][0]["finish_reason"] == "abort"
    assert _room_record(pair.d, room)["outcome"] == "aborted"
    assert _rooms_of(pair.d)["pending"] == [] and _rooms_of(pair.p)["pending"] == []
    assert stats(pair.d)["active"] == []


def test_abort_on_prefill_fails_the_decode_wait(pair: Pair) -> None:
    body = pair.body("pd-abort-p")
    room = body["bootstrap_room"]
    from_p = pair.submit(pair.p, body)
    _pending(pair.p, lambda r: r["rid"] == "pd-abort-p")
    assert pair.p.post("/abort_request", json={"rid": "pd-abort-p"}).status_code == 200
    answer = from_p.result()
    assert answer.status_code == 200
    assert answer.json()["choices"][0]["finish_reason"] == "abort"
    assert _room_record(pair.p, room)["outcome"] == "aborted"
    assert _rooms_of(pair.p)["pending"] == []
    # The decode side learns the room failed (not after its waiting timeout).
    late = pair.d.post(CHAT_PATH, json=body)
    assert late.status_code == 500
    assert late.json()["message"].endswith(
        f"KVTransferError(bootstrap_room={room}): Aborted by AbortReq."
    )
    assert _room_record(pair.d, room)["outcome"] == "failed"
    assert _rooms_of(pair.d)["pending"] == []


@pytest.mark.parametrize("side", ["p", "d"])
def test_request_without_bootstrap_room_is_refused(pair: Pair, side: str) -> None:
    client = pair.p if side == "p" else pair.d
    plain = {**CHAT, "rid": f"no-room-{side}"}
    answer = client.post(CHAT_PATH, json=plain)
    message = (
        "Invalid request: Disaggregated request received without bootstrap room id. "
        f"req.rid='no-room-{side}'"
    )
    assert answer.status_code == 400
    assert answer.json() == {
        "object": "error",
        "message": message,
        "type": "BadRequestError",
        "param": None,
        "code": 400,
    }
    with client.stream("POST", CHAT_PATH, json={**plain, "stream": True}) as response:
        assert response.status_code == 200
        got = list(events(response))
    assert got[0]["error"]["code"] == 400 and got[0]["error"]["type"] == "BAD_REQUEST"
    assert got[-1] == "[DONE]"


def test_bad_bootstrap_fields_are_a_400(pair: Pair) -> None:
    answer = pair.d.post(CHAT_PATH, json={**pair.body("bad"), "bootstrap_room": "seven"})
    assert answer.status_code == 400
    assert "bootstrap_room" in answer.json()["message"]


def test_roles_in_server_info_model_info_and_loads(pair: Pair) -> None:
    for client, mode in ((pair.p, "prefill"), (pair.d, "decode")):
        info = client.get("/server_info").json()
        assert info["disaggregation_mode"] == mode
        assert info["disaggregation_transfer_backend"] == "mooncake"
        assert client.get("/get_model_info").json()["disaggregation_mode"] == mode
        load = client.get("/v1/loads", params={"include": "core,disagg"}).json()["loads"][0]
        assert load["disaggregation"]["mode"] == mode
        plain = client.get("/v1/loads", params={"include": "core"}).json()["loads"][0]
        assert "disaggregation" not in plain
        # SGLang labels a PD server's series with its role (``to_engine_type``).
        _, labels = _metric(client, "sglang:num_running_reqs")
        assert labels["engine_type"] == mode
    assert pair.p.get("/server_info").json()["disaggregation_bootstrap_port"] == pair.bootstrap_port


def test_bootstrap_server_routes(pair: Pair) -> None:
    with httpx.Client(base_url=f"http://127.0.0.1:{pair.bootstrap_port}", timeout=10) as boot:
        assert boot.get("/health").text == "OK"
        ranks = ("prefill_dp_rank", "prefill_cp_rank", "target_tp_rank", "target_pp_rank")
        info = boot.get("/route", params=dict.fromkeys(ranks, -1)).json()
        assert (info["attn_tp_size"], info["dp_size"], info["pp_size"]) == (8, 1, 1)
        assert info["prefill_http_port"] == pair.prefill.port
        rank = boot.get("/route", params=dict.fromkeys(ranks, 0)).json()
        assert rank == {"rank_ip": "127.0.0.1", "rank_port": pair.bootstrap_port}
        missing = boot.get("/route", params={"prefill_dp_rank": 0})
        assert (missing.status_code, missing.text) == (400, "Missing inputs for bootstrap server.")
        assert (
            boot.get("/route", params={**dict.fromkeys(ranks, 0), "target_tp_rank": 8}).status_code
            == 404
        )
        assert boot.post("/route").status_code == 405
        # The OpenAI surface is not on the bootstrap port.
        assert boot.post(CHAT_PATH, json=CHAT).status_code == 404


def test_fake_backend_needs_no_partner(procs: ProcessManager) -> None:
    """``--disaggregation-transfer-backend fake`` (SGLang's ``fake/conn.py``): no handshake, no
    room needed, the transfer succeeds at once; each role answers alone."""
    fake = ["--disaggregation-transfer-backend", "fake"]
    boot = str(free_port())
    prefill = procs.start(
        [
            *EMULATE,
            "--disaggregation-mode",
            "prefill",
            "--disaggregation-bootstrap-port",
            boot,
            *fake,
        ],
        name="prefill",
    )
    decode = procs.start([*EMULATE, "--disaggregation-mode", "decode", *fake], name="decode")
    body = {**CHAT, "max_tokens": 12}
    with httpx.Client(timeout=30) as client:
        p = client.post(prefill.url + CHAT_PATH, json=body).json()
        d = client.post(decode.url + CHAT_PATH, json=body).json()
        assert p["usage"]["completion_tokens"] == 1
        assert d["usage"]["completion_tokens"] == 12
        d_rooms = client.get(decode.url + "/emulator/stats").json()["rooms"]
    assert [r["outcome"] for r in d_rooms["records"]] == ["served"]


def test_decode_fails_when_its_prefill_server_dies(procs: ProcessManager) -> None:
    """A bootstrap server that stops answering fails the rooms waiting on it ("Lost connection
    with prefill instance"), after heartbeat_max_failure tries heartbeat_interval apart."""
    boot = free_port()
    prefill = procs.start(
        [
            *EMULATE,
            "--disaggregation-mode",
            "prefill",
            "--disaggregation-bootstrap-port",
            str(boot),
        ],
        name="prefill",
    )
    decode = procs.start(
        [
            *EMULATE,
            "--disaggregation-mode",
            "decode",
            "--disaggregation-heartbeat-interval",
            "0.2",
        ],
        name="decode",
    )
    body = {
        **CHAT,
        "rid": "orphan",
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": boot,
        "bootstrap_room": 99,
    }
    with (
        httpx.Client(base_url=decode.url, timeout=60) as d,
        ThreadPoolExecutor(max_workers=1) as pool,
    ):
        answer = pool.submit(d.post, CHAT_PATH, json=body)
        _pending(d, lambda r: r["room"] == 99 and r["status"] == "WaitingForInput")
        prefill.kill()
        got = answer.result()
        assert got.status_code == 500
        assert got.json()["message"].endswith(
            f"KVTransferError(bootstrap_room=99): Lost connection with prefill instance "
            f"(bootstrap_addr: 127.0.0.1:{boot})"
        )
        assert _room_record(d, 99)["outcome"] == "failed"
        assert _rooms_of(d)["pending"] == [] and stats(d)["active"] == []


def test_prefill_gives_up_when_no_decode_side_comes(procs: ProcessManager) -> None:
    """P waits for D's destination at most the bootstrap timeout, then fails like SGLang. (Late
    arrivals on a failed room fail at once: the timeout and abort tests above.)"""
    boot = free_port()
    prefill = procs.start(
        [
            *EMULATE,
            "--disaggregation-mode",
            "prefill",
            "--disaggregation-bootstrap-port",
            str(boot),
            "--disaggregation-bootstrap-timeout",
            "1",
        ],
        name="prefill",
    )
    body = {**CHAT, "rid": "alone", "bootstrap_host": "127.0.0.1", "bootstrap_port": boot}
    with httpx.Client(base_url=prefill.url, timeout=30) as p:
        answer = p.post(CHAT_PATH, json={**body, "bootstrap_room": 5})
        assert answer.status_code == 500
        assert answer.json()["message"] == (
            "Prefill bootstrap failed for request rank=0 req.rid='alone' req.bootstrap_room=5 "
            "with exception KVTransferError(bootstrap_room=5): Request 5 timed out after 1.0s "
            "in KVPoll.Bootstrapping"
        )
        assert _room_record(p, 5)["outcome"] == "bootstrap_timeout"
        assert _metric(p, "sglang:num_bootstrap_failed_reqs_total")[0] == 1
        assert _rooms_of(p)["pending"] == []
        streamed = p.post(CHAT_PATH, json={**body, "bootstrap_room": 6, "stream": True})
        assert streamed.status_code == 200 and "KVPoll.Bootstrapping" in streamed.text
        assert streamed.text.endswith("data: [DONE]\n\n")
