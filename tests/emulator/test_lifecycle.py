"""Queueing and queue-full, warm-up, client disconnect, prefix cache, metrics, stats file,
process death and replay - each on its own emulator process where flags differ."""

from __future__ import annotations

import socket
import threading
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from app.emulator.cache import DEFAULT_PAGE_SIZE
from tests.emulator.support import CHAT, events, record, stats, wait_for
from tests.support.procs import PYTHON, ManagedProcess, ProcessManager

EMULATE = [PYTHON, "-m", "app", "emulate", "--port", "{port}", "--speed", "50"]
LONG = {**CHAT, "max_tokens": 100000, "ignore_eos": True, "stream": True}


def _stream_in_thread(url: str, body: dict[str, Any], out: list[Any]) -> threading.Thread:
    def run() -> None:
        with (
            httpx.Client(base_url=url, timeout=30) as client,
            client.stream("POST", "/v1/chat/completions", json=body) as response,
        ):
            out.append(response.status_code)
            out.extend(events(response))

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def _loads(client: httpx.Client) -> dict[str, Any]:
    load: dict[str, Any] = client.get("/v1/loads", params={"include": "core,spec"}).json()
    return load["loads"][0]


def test_queueing_and_queue_full(procs: ProcessManager) -> None:
    emu = procs.start(
        [*EMULATE, "--max-running-requests", "1", "--max-queued-requests", "1"], name="emu"
    )
    with httpx.Client(base_url=emu.url, timeout=30) as client:
        client.post("/emulator/gate", json={"hold_after_chunks": 1})
        first: list[Any] = []
        queued: list[Any] = []
        t1 = _stream_in_thread(emu.url, {**LONG, "rid": "running"}, first)
        wait_for(lambda: client.get("/emulator/gate").json()["held"] == 1, what="running")
        t2 = _stream_in_thread(emu.url, {**CHAT, "stream": True, "max_tokens": 5}, queued)
        wait_for(lambda: _loads(client)["num_waiting_reqs"] == 1, what="one waiting")
        assert _loads(client)["num_running_reqs"] == 1
        # Non-streaming: HTTP 503 with SGLang's ErrorResponse.
        full = client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 5})
        assert full.status_code == 503
        assert full.json() == {
            "object": "error",
            "message": "The request queue is full.",
            "type": "503",
            "param": None,
            "code": 503,
        }
        # Streaming: SGLang answers 200 with one in-band error event, then [DONE].
        with client.stream("POST", "/v1/chat/completions", json=LONG) as response:
            assert response.status_code == 200
            got = list(events(response))
        assert got[0]["error"]["message"] == "The request queue is full."
        assert got[0]["error"]["code"] == 503 and got[1:] == ["[DONE]"]
        assert stats(client)["totals"]["queue_rejected"] == 2
        client.post("/emulator/gate", json={"release": True})
        client.post("/abort_request", json={"rid": "running"})
        t1.join(30)
        t2.join(30)
    assert first[-2]["choices"][0]["finish_reason"] == "abort"
    assert queued[0] == 200 and queued[-1] == "[DONE]"
    assert queued[-2]["choices"][0]["finish_reason"] == "length"


def test_api_key_like_sglang(procs: ProcessManager) -> None:
    emu = procs.start([*EMULATE, "--api-key", "sekrit"], name="emu")
    with httpx.Client(base_url=emu.url, timeout=30) as client:
        denied = client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 2})
        assert denied.status_code == 401 and denied.json() == {"error": "Unauthorized"}
        assert client.get("/v1/models", headers={"Authorization": "Bearer nope"}).status_code == 401
        assert client.post("/abort_request", json={"rid": "x"}).status_code == 401
        auth = {"Authorization": "Bearer sekrit"}
        ok = client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 2}, headers=auth)
        assert ok.status_code == 200
        for path in ("/health", "/health_generate", "/ready", "/metrics", "/emulator/stats"):
            assert client.get(path).status_code == 200, path


def test_warmup_health_503_then_200(procs: ProcessManager) -> None:
    emu = procs.start([*EMULATE, "--warmup-s", "2"], name="emu", ready_path="/v1/models")
    with httpx.Client(base_url=emu.url, timeout=30) as client:
        assert client.get("/health").status_code == 503
        assert client.get("/health_generate").status_code == 503
        assert client.get("/ready").status_code == 503
        wait_for(lambda: client.get("/health").status_code == 200, what="warm")
        assert client.get("/health_generate").status_code == 200


def test_client_disconnect_aborts_and_is_counted(emu: ManagedProcess) -> None:
    with httpx.Client(base_url=emu.url, timeout=30) as client:
        client.post("/emulator/gate", json={"hold_after_chunks": 2})
        with client.stream("POST", "/v1/chat/completions", json={**LONG, "rid": "gone"}) as r:
            lines = r.iter_lines()
            next(lines)
            wait_for(lambda: client.get("/emulator/gate").json()["held"] == 1, what="held")
        # Leaving the block closed the connection mid-stream.
        assert record(client, "gone")["aborted"] == "disconnect"
        client.post("/emulator/gate", json={"release": True})
        # A non-streaming request whose client hangs up while it runs (no timing involved:
        # the socket closes once the emulator reports the request active).
        payload = orjson.dumps({**LONG, "stream": False, "rid": "gone-too"})
        with socket.create_connection(("127.0.0.1", emu.port)) as sock:
            sock.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: emulator\r\n"
                b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                % (len(payload), payload)
            )
            wait_for(lambda: "gone-too" in stats(client)["active"], what="gone-too running")
        wait_for(lambda: record(client, "gone-too")["aborted"] == "disconnect", what="aborted")
        assert stats(client)["totals"]["disconnects"] == 2
        metrics = client.get("/metrics").text
    aborted = _sample(metrics, "sglang:num_aborted_requests_total")
    assert aborted >= 2


def _sample(text: str, name: str, **labels: str) -> float:
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and labels.items() <= sample.labels.items():
                return float(sample.value)
    raise AssertionError(f"{name} {labels} not found")


def test_prefix_cache_reports_cached_tokens_and_shortens_prefill(emu: ManagedProcess) -> None:
    system = "You are a careful assistant. " * 80
    convo = [{"role": "system", "content": system}, {"role": "user", "content": "Hi!"}]
    with httpx.Client(base_url=emu.url, timeout=30) as client:
        client.post("/flush_cache")

        def ask(rid: str, messages: list[Any]) -> dict[str, Any]:
            body = {"messages": messages, "max_tokens": 3, "rid": rid}
            out: dict[str, Any] = client.post("/v1/chat/completions", json=body).json()
            return out

        cold = ask("cold", convo)
        follow_up = [{"role": "assistant", "content": "Hello."}, {"role": "user", "content": "?"}]
        warm = ask("warm", [*convo, *follow_up])
        assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        cached = warm["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached >= len(system) // 4 - DEFAULT_PAGE_SIZE, "whole pages of the system prompt"
        assert cached % DEFAULT_PAGE_SIZE == 0
        assert record(client, "warm")["prefill_s"] < record(client, "cold")["prefill_s"]
        assert client.post("/flush_cache").status_code == 200
        again = ask("again", convo)
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        # Not idle: SGLang refuses to flush.
        client.post("/emulator/gate", json={"hold_after_chunks": 1})
        out: list[Any] = []
        thread = _stream_in_thread(emu.url, {**LONG, "rid": "busy"}, out)
        wait_for(lambda: client.get("/emulator/gate").json()["held"] == 1, what="held")
        assert client.get("/flush_cache").status_code == 400
        client.post("/abort_request", json={"rid": "busy"})
        client.post("/emulator/gate", json={"release": True})
        thread.join(30)


def test_metrics_names_labels_buckets(procs: ProcessManager) -> None:
    emu = procs.start(EMULATE, name="emu")
    with httpx.Client(base_url=emu.url, timeout=30) as client:
        client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 20})
        client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 20, "stream": True})
        text = client.get("/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    sched = {"model_name", "engine_type", "tp_rank", "pp_rank", "moe_ep_rank"}
    gauges = ("num_running_reqs", "num_queue_reqs", "gen_throughput", "token_usage")
    for name in (*gauges, "spec_accept_length", "spec_accept_rate"):
        family = families[f"sglang:{name}"]
        assert family.type == "gauge"
        assert set(family.samples[0].labels) == sched
    tok = {"model_name", "engine_type"}
    counters: list[tuple[str, set[str]]] = [
        ("prompt_tokens", {"is_streaming"}),
        ("generation_tokens", {"is_streaming"}),
        ("spec_verify_calls", set()),
        ("num_requests", {"is_streaming"}),
        ("num_aborted_requests", set()),
    ]
    for name, extra in counters:
        family = families[f"sglang:{name}"]
        assert family.type == "counter"
        assert {s.name for s in family.samples} >= {f"sglang:{name}_total"}
        assert set(family.samples[0].labels) == tok | extra
    buckets = {
        "time_to_first_token_seconds": ("0.1", "400.0"),
        "inter_token_latency_seconds": ("0.002", "8.0"),
        "e2e_request_latency_seconds": ("0.1", "2400.0"),
    }
    for name, (low, high) in buckets.items():
        family = families[f"sglang:{name}"]
        assert family.type == "histogram"
        les = [s.labels["le"] for s in family.samples if s.name.endswith("_bucket")]
        assert les[0] == low and high in les and les[-1] == "+Inf"
    assert _sample(text, "sglang:generation_tokens_total", is_streaming="false") == 20
    assert _sample(text, "sglang:num_requests_total", is_streaming="true") == 1
    assert _sample(text, "sglang:spec_accept_length") > 1


def test_stats_file_survives_kill(procs: ProcessManager, tmp_path: Path) -> None:
    path = tmp_path / "stats.jsonl"
    emu = procs.start([*EMULATE, "--stats-file", str(path)], name="emu")
    with httpx.Client(base_url=emu.url, timeout=30) as client:
        for rid in ("file-1", "file-2"):
            client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 9, "rid": rid})
    emu.kill()
    rows = [orjson.loads(line) for line in path.read_bytes().splitlines()]
    assert [r["rid"] for r in rows] == ["file-1", "file-2"]
    assert all(r["completion_tokens"] == 9 and r["steps"] >= 2 for r in rows)


def test_die_process_mode(procs: ProcessManager, tmp_path: Path) -> None:
    path = tmp_path / "stats.jsonl"
    argv = [*EMULATE, "--die-after-chunks", "2", "--die-mode", "process", "--stats-file", str(path)]
    emu = procs.start(argv, name="emu")
    got: list[Any] = []
    with (
        httpx.Client(base_url=emu.url, timeout=30) as client,
        pytest.raises(httpx.RemoteProtocolError),
        client.stream("POST", "/v1/chat/completions", json={**LONG, "rid": "crash"}) as r,
    ):
        got.extend(events(r))
    assert len(got) == 2
    wait_for(lambda: not emu.alive(), what="process exit")
    rows = [orjson.loads(line) for line in path.read_bytes().splitlines()]
    assert rows[-1]["rid"] == "crash" and rows[-1]["error"] == "die_after_chunks"


def test_replay_mode(procs: ProcessManager) -> None:
    emu = procs.start([*EMULATE, "--replay"], name="emu")
    with httpx.Client(base_url=emu.url, timeout=30) as client:
        body = {**CHAT, "max_tokens": 64, "stream_options": {"include_usage": True}}
        one = list(_events(client, {**body, "rid": "replay-1"}))
        two = list(_events(client, {**body, "rid": "replay-2"}))
        plain = client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 64}).json()
        rec = record(client, "replay-2")
    assert one[-1] == two[-1] == "[DONE]"
    assert {c["id"] for c in one[:-1]} == {"replay-1"}
    assert {c["id"] for c in two[:-1]} == {"replay-2"}
    assert [c["choices"] for c in one[:-1]] == [c["choices"] for c in two[:-1]]
    assert one[-2]["usage"]["completion_tokens"] == 64 == plain["usage"]["completion_tokens"]
    assert sum(rec["tokens_per_step"]) == 64


def _events(client: httpx.Client, body: dict[str, Any]) -> list[Any]:
    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        return list(events(r))
