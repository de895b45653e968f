"""What a client's body can make a worker do, seen from the worker: a real gateway process in front
of a recording worker (tests/security/recorder.py) that keeps the exact bytes it was sent."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import httpx
import orjson

from tests.security.recorder import MODEL, recording_worker
from tests.security.stack import CHAT, error_of, start_gateway
from tests.support.procs import ProcessManager

COMPLETIONS = "/v1/completions"


def _chat(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **extra}


def test_the_worker_gets_a_bounded_allow_listed_body(procs: ProcessManager) -> None:
    with recording_worker() as worker:
        gw = start_gateway(procs, [], args=("--worker-url", worker.url))
        ok = httpx.post(
            gw.url + CHAT,
            json=_chat(chat_template_kwargs={"thinking": False}, top_k=20, foo={"a": [1]}),
            timeout=30,
        )
        assert ok.status_code == 200, ok.text
        sent = worker.json()
        # No max_tokens from the client: the documented default, not "up to the context".
        assert sent["max_tokens"] == 16384
        # Kimi's thinking switch and SGLang's sampling extensions pass; an unknown field does not.
        assert sent["chat_template_kwargs"] == {"thinking": False} and sent["top_k"] == 20
        assert "foo" not in sent

        capped = httpx.post(gw.url + CHAT, json=_chat(max_completion_tokens=10**6), timeout=30)
        assert capped.status_code == 200
        assert worker.json()["max_completion_tokens"] == 32768

        for field, value in (
            ("custom_logit_processor", '{"callable": "..."}'),
            ("bootstrap_host", "10.0.0.1"),
            ("lora_path", "/tmp/adapter"),
            ("priority", -100),
            ("rid", "mine"),
        ):
            refused = httpx.post(gw.url + CHAT, json=_chat(**{field: value}), timeout=30)
            assert refused.status_code == 400, field
            assert error_of(refused)["param"] == field
            assert field in error_of(refused)["message"]
        too_many = httpx.post(gw.url + CHAT, json=_chat(n=100000), timeout=30)
        assert too_many.status_code == 400 and error_of(too_many)["param"] == "n"
        prompt = {"model": MODEL, "prompt": "x", "best_of": 1000}
        best_of = httpx.post(gw.url + COMPLETIONS, json=prompt, timeout=30)
        assert best_of.status_code == 400 and error_of(best_of)["param"] == "best_of"
        assert len(worker.bodies) == 2  # none of the refused ones reached it

        metrics = httpx.get(gw.url + "/metrics", timeout=10).text
        dropped = "dflash_gateway_requests_with_dropped_fields_total"
        assert f'{dropped}{{route="/v1/chat/completions"}} 1.0' in metrics
        assert f'{dropped}{{route="/v1/completions"}} 0.0' in metrics


def test_extra_fields_setting_allows_a_field(procs: ProcessManager) -> None:
    with recording_worker() as worker:
        gw = start_gateway(
            procs,
            [],
            args=("--worker-url", worker.url),
            env={"DFLASH_GATEWAY_LIMITS__EXTRA_FIELDS": "lora_path,return_text_in_logprobs"},
        )
        body = _chat(lora_path="adapter-a", return_text_in_logprobs=True, max_tokens=5)
        assert httpx.post(gw.url + CHAT, json=body, timeout=30).status_code == 200
        sent = worker.json()
        assert sent["lora_path"] == "adapter-a" and sent["return_text_in_logprobs"] is True
        assert sent["max_tokens"] == 5


def _status(pid: int) -> dict[str, int]:
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    fields = dict(line.split(":", 1) for line in lines)
    return {key: int(fields[key].split()[0]) * 1024 for key in ("VmRSS", "VmHWM")}


def test_one_8_mib_body_of_small_objects_costs_at_most_three_times_its_size(
    procs: ProcessManager,
) -> None:
    """Held in flight at the worker, a request whose body is 8 MiB of small objects (content
    parts) raises the gateway's peak RSS by about 3x the body, not by the ~140 MiB its objects
    took when the whole body was decoded. What it holds: the client's bytes (kept for a retry;
    the upstream request is written as pieces of them, never joined) and what the socket's send
    buffer has not taken yet."""
    part = b'{"type":"text","text":"a"},'
    parts = (8 * 1024 * 1024 - 200) // len(part)
    content = b"[" + part * parts + b'{"type":"text","text":"a"}]'
    raw = b'{"model":"%s","max_tokens":4,"messages":[{"role":"user","content":%s}]}' % (
        MODEL.encode(),
        content,
    )
    assert 8 * 1024 * 1024 - 1024 < len(raw) <= 8 * 1024 * 1024

    with recording_worker() as worker:
        gw = start_gateway(procs, [], args=("--worker-url", worker.url))
        small = _chat(max_tokens=4)
        for _ in range(3):  # warm: imports, pools, first-request caches
            assert httpx.post(gw.url + CHAT, json=small, timeout=30).status_code == 200
        before = _status(gw.pid)
        reset = Path(f"/proc/{gw.pid}/clear_refs")
        reset.write_text("5")  # the peak (VmHWM) starts again from the current RSS
        worker.hold()
        answers: list[httpx.Response] = []

        def send() -> None:
            headers = {"content-type": "application/json"}
            answers.append(httpx.post(gw.url + CHAT, content=raw, headers=headers, timeout=120))

        client = threading.Thread(target=send)
        client.start()
        try:
            assert worker.received.wait(120), "the worker never got the body"
            held = _status(gw.pid)
        finally:
            worker.release()
            client.join(120)
        assert answers and answers[0].status_code == 200, answers
        assert orjson.loads(worker.bodies[-1])["messages"][0]["content"][0]["text"] == "a"
        growth = held["VmHWM"] - before["VmRSS"]
        print(f"peak RSS growth: {growth / 2**20:.1f} MiB for an 8 MiB body")
        assert growth <= 3 * len(raw), f"peak RSS grew {growth / 2**20:.1f} MiB for 8 MiB"
        assert "Traceback" not in gw.logs()


def test_metadata_is_bounded_as_openai_bounds_it_on_every_surface(procs: ProcessManager) -> None:
    """16 pairs, keys up to 64 characters, string values up to 512: the most is accepted, one
    more of anything is a 400 naming ``metadata`` on chat, Responses and Messages, and none of
    the refused reaches the worker; Messages' ``metadata.user_id`` stays the routing key."""
    largest = {f"k{i:02d}" + "x" * 61: "v" * 512 for i in range(16)}
    over = [
        {f"k{i}": "v" for i in range(17)},
        {"k" * 65: "v"},
        {"k": "v" * 513},
        {"k": 1},
        {"k": {"nested": "v"}},
        ["not", "an", "object"],
        {"k": "é" * 513},
    ]
    messages = {"model": MODEL, "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]}
    with recording_worker() as worker:
        gw = start_gateway(procs, [], args=("--worker-url", worker.url))
        ok = httpx.post(gw.url + CHAT, json=_chat(metadata=largest), timeout=30)
        assert ok.status_code == 200, ok.text
        assert worker.json()["metadata"] == largest
        ok = httpx.post(
            gw.url + "/v1/responses",
            json={"model": MODEL, "input": "hi", "metadata": largest},
            timeout=30,
        )
        assert ok.status_code == 200 and ok.json()["metadata"] == largest
        routed = messages | {"metadata": {"user_id": "user-7"}}
        ok = httpx.post(gw.url + "/v1/messages", json=routed, timeout=30)
        assert ok.status_code == 200, ok.text
        assert worker.json()["user"] == "user-7"
        seen = len(worker.bodies)

        for value in over:
            chat = httpx.post(gw.url + CHAT, json=_chat(metadata=value), timeout=30)
            assert chat.status_code == 400, (value, chat.text)
            assert error_of(chat)["param"] == "metadata"
            responses = httpx.post(
                gw.url + "/v1/responses",
                json={"model": MODEL, "input": "hi", "metadata": value},
                timeout=30,
            )
            assert responses.status_code == 400, (value, responses.text)
            assert error_of(responses)["param"] == "metadata"
            anthropic = httpx.post(
                gw.url + "/v1/messages", json=messages | {"metadata": value}, timeout=30
            )
            assert anthropic.status_code == 400, (value, anthropic.text)
            assert anthropic.json()["type"] == "error"
            assert anthropic.json()["error"]["type"] == "invalid_request_error"
            assert "metadata" in anthropic.json()["error"]["message"]
        # Seven megabytes of metadata on a cheap request: refused before it is decoded.
        huge = {f"k{i}": "v" * 500_000 for i in range(14)}
        refused = httpx.post(
            gw.url + "/v1/responses",
            json={"model": MODEL, "input": "hi", "metadata": huge},
            timeout=30,
        )
        assert refused.status_code == 400 and error_of(refused)["param"] == "metadata"
        assert len(worker.bodies) == seen
