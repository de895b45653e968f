"""What a client sees when its worker misbehaves at the byte level: a real gateway process in
front of a fake worker (raw asyncio on loopback, in a thread of this process) that is healthy for
the gateway's checks and answers each completion the way its request's text names."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import orjson
import pytest

from tests.e2e.conftest import gateway, poll
from tests.support.procs import ManagedProcess, managed_processes
from tests.support.threaded_worker import ThreadedWorker

MODEL = "moonshotai/Kimi-K2.5"
CHAT = "/v1/chat/completions"


def completion(text: str, usage: dict[str, int] | None = None, *, rid: str = "cmpl-1") -> bytes:
    return orjson.dumps(
        {
            "id": rid,  # SGLang answers with the request's rid as the id
            "object": "chat.completion",
            "model": MODEL,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "finish_reason": "stop",
                }
            ],
            "usage": usage or {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
        }
    )


def response(
    body: bytes, *, status: bytes = b"200 OK", content_type: bytes = b"application/json"
) -> bytes:
    return b"HTTP/1.1 %s\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n%s" % (
        status,
        content_type,
        len(body),
        body,
    )


def sse_event(text: str, rid: str = "c") -> bytes:
    delta = {"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]}
    return (
        b"data: " + orjson.dumps({"id": rid, "object": "chat.completion.chunk", **delta}) + b"\n\n"
    )


def stream(*events: bytes) -> bytes:
    head = (
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    )
    return head + b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in events) + b"0\r\n\r\n"


def open_stream(*events: bytes) -> bytes:
    """A stream's head and events with no end of its body: the connection stays open."""
    return stream(*events)[: -len(b"0\r\n\r\n")]


def chunk_of(rid: str, **fields: Any) -> bytes:
    return (
        b"data: " + orjson.dumps({"id": rid, "object": "chat.completion.chunk", **fields}) + b"\n\n"
    )


def tool_chunk(rid: str, function: Any) -> bytes:
    call = {"index": 0, "id": "functions.f:0", "type": "function", "function": function}
    delta = {"tool_calls": [call]}
    return chunk_of(rid, choices=[{"index": 0, "delta": delta, "finish_reason": None}])


def _split(answer: bytes, at: bytes) -> tuple[bytes, bytes]:
    """``answer`` in two writes, the second from the chunk that holds ``at``."""
    cut = answer.rfind(b"\r\n", 0, answer.index(at) - 2) + 2
    return answer[:cut], answer[cut:]


DONE = b"data: [DONE]\n\n"
STRAY = response(completion("a stray answer nobody asked for"))
SGLANG_TOO_LONG = (
    b'{"object":"error","message":"The input (9000 tokens) is longer than the model\'s context '
    b'length (8192 tokens).","type":"BadRequestError","param":null,"code":400}'
)

NEGATIVE = {"prompt_tokens": -1000, "completion_tokens": -7, "total_tokens": -1007}
# JSON allows integers of any size (orjson writes none over 64 bits: spliced in as text).
HUGE = b'"usage":{"prompt_tokens":1%s,"completion_tokens":%d,"total_tokens":1}' % (
    b"0" * 400,
    2**63,
)

# The worker's answer to a completion whose text is "<scenario> <tag>".
SCENARIOS: dict[str, Callable[[str, str], bytes | tuple[bytes, ...]]] = {
    "ok": lambda tag, rid: response(completion(tag, rid=rid)),
    "stray": lambda tag, rid: response(completion(tag, rid=rid)) + STRAY,
    "upgrade": lambda tag, rid: (
        b"HTTP/1.1 101 Switching Protocols\r\nupgrade: websocket\r\nconnection: upgrade\r\n\r\n"
    ),
    "bighead": lambda tag, rid: (
        b"HTTP/1.1 200 OK\r\nx-big: "
        + b"a" * (1024 * 1024)
        + b"\r\n"
        + response(completion(tag, rid=rid))[17:]
    ),
    "short": lambda tag, rid: (
        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 10\r\n\r\n"
        + completion(tag, rid=rid)
    ),
    "html": lambda tag, rid: response(completion(tag, rid=rid), content_type=b"text/html"),
    "notjson": lambda tag, rid: response(
        b"<html>" + tag.encode() + b"</html>", content_type=b"text/html"
    ),
    "toolong": lambda tag, rid: response(SGLANG_TOO_LONG, status=b"400 Bad Request"),
    # Over the gateway's limits.max_response_bytes (1 MiB in this module).
    "huge": lambda tag, rid: response(b'{"pad":"' + b"a" * (2 * 1024 * 1024) + b'"}'),
    "done-in-text": lambda tag, rid: stream(sse_event(tag, rid), sse_event("data: [DONE]", rid)),
    "negative": lambda tag, rid: response(completion(tag, NEGATIVE, rid=rid)),
    "hugecount": lambda tag, rid: response(
        completion(tag, rid=rid).split(b'"usage":')[0] + HUGE + b"}"
    ),
    # Data after [DONE] (then the worker keeps the response open), or [DONE] and silence.
    "after-done": lambda tag, rid: open_stream(
        sse_event(tag, rid), DONE, sse_event("INJECTED", rid), chunk_of(rid, choices="x")
    ),
    "after-done-later": lambda tag, rid: _split(
        open_stream(sse_event(tag, rid), DONE, sse_event("INJECTED", rid)),
        sse_event("INJECTED", rid),
    ),
    "done-silent": lambda tag, rid: open_stream(sse_event(tag, rid), DONE),
    # Chunks without the chat chunk's shape: first, or after the commit point.
    "bad-choices": lambda tag, rid: stream(chunk_of(rid, choices="x"), DONE),
    "bad-function": lambda tag, rid: _split(
        stream(sse_event(tag, rid), tool_chunk(rid, "zz"), DONE), tool_chunk(rid, "zz")
    ),
    "bad-message": lambda tag, rid: response(
        orjson.dumps({"id": rid, "object": "chat.completion", "choices": ["x"]})
    ),
    "negative-stream": lambda tag, rid: stream(
        sse_event(tag, rid),
        b"data: " + orjson.dumps({"id": "c", "choices": [], "usage": NEGATIVE}) + b"\n\n",
        b"data: [DONE]\n\n",
    ),
}


class FakeWorker(ThreadedWorker):
    """An HTTP/1.1 worker on 127.0.0.1 in its own thread and event loop, answering from
    ``SCENARIOS`` (a tuple answer: its parts in separate writes, 50 ms apart)."""

    async def handle(self, path: str, body: bytes, writer: asyncio.StreamWriter) -> None:
        answer = self._answer(path, body)
        for i, part in enumerate([answer] if isinstance(answer, bytes) else answer):
            if i:  # a later part: in a later read of the gateway's
                await asyncio.sleep(0.05)
            writer.write(part)
            await writer.drain()

    def _answer(self, path: str, body: bytes) -> bytes | tuple[bytes, ...]:
        if path == "/v1/models":
            return response(
                orjson.dumps({"object": "list", "data": [{"id": MODEL, "object": "model"}]})
            )
        if path == CHAT:
            request = orjson.loads(body)
            text = request["messages"][-1]["content"]
            scenario, _, tag = text.partition(" ")
            return SCENARIOS[scenario](tag, request["rid"])
        return response(b"{}")  # /health, /v1/loads, /abort_request


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ManagedProcess]:
    with FakeWorker() as worker, managed_processes(tmp_path_factory, "hostile") as manager:
        # Every answer here is the worker's fault: keep its breaker closed for the next test.
        env = {
            "DFLASH_GATEWAY_BREAKER__FAILURE_THRESHOLD": "1000",
            "DFLASH_GATEWAY_LIMITS__MAX_RESPONSE_BYTES": str(1024 * 1024),
        }
        yield gateway(manager, [worker.url], env=env)


def ask(gw: ManagedProcess, text: str, **extra: Any) -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": text}]} | extra
    return httpx.post(gw.url + CHAT, json=body, timeout=30)


def error_of(response: httpx.Response) -> dict[str, Any]:
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]  # type: ignore[no-any-return]


def content_of(response: httpx.Response) -> str:
    return response.json()["choices"][0]["message"]["content"]  # type: ignore[no-any-return]


@pytest.mark.parametrize("scenario", ["stray", "upgrade", "bighead", "short", "notjson", "huge"])
def test_a_bad_answer_is_a_clean_502_and_the_next_client_gets_its_own(
    gw: ManagedProcess, scenario: str
) -> None:
    bad = ask(gw, f"{scenario} A")
    assert bad.status_code == 502, bad.text
    assert bad.headers["content-type"] == "application/json"
    error = error_of(bad)
    assert (error["type"], error["code"]) == ("upstream_error", "bad_upstream_response")
    assert "stray" not in bad.text and "aaaa" not in bad.text
    for tag in ("B", "C"):  # whatever connection the bad answer came on, it is not reused
        good = ask(gw, f"ok {tag}")
        assert good.status_code == 200, good.text
        assert content_of(good) == tag


def test_no_worker_bytes_escape_as_a_transport_error(gw: ManagedProcess) -> None:
    assert ask(gw, "upgrade A").status_code == 502
    assert "Fatal error" not in gw.logs()


def test_a_json_answer_is_relayed_as_json_whatever_the_worker_called_it(
    gw: ManagedProcess,
) -> None:
    answer = ask(gw, "html A")
    assert answer.status_code == 200
    assert answer.headers["content-type"] == "application/json"
    assert content_of(answer) == "A"


def test_done_inside_the_text_does_not_hide_a_cut_stream(gw: ManagedProcess) -> None:
    answer = ask(gw, "done-in-text A", stream=True)
    assert answer.status_code == 200
    events = [e[len("data: ") :] for e in answer.text.split("\n\n") if e.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert orjson.loads(events[-2])["error"]["code"] == "stream_interrupted"
    assert [orjson.loads(e)["choices"][0]["delta"]["content"] for e in events[:2]] == [
        "A",
        "data: [DONE]",
    ]


def test_a_worker_refusal_keeps_its_words_in_openai_shape(gw: ManagedProcess) -> None:
    refused = ask(gw, "toolong A")
    assert refused.status_code == 400
    assert error_of(refused) == {
        "message": "The input (9000 tokens) is longer than the model's context length "
        "(8192 tokens).",
        "type": "invalid_request_error",
        "param": None,
        "code": "context_length_exceeded",
    }


def token_totals(gw: ManagedProcess) -> dict[str, float]:
    text = httpx.get(gw.url + "/metrics", timeout=10).text
    totals: dict[str, float] = {}
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in ("dflash_gateway_prompt_tokens_total", "dflash_gateway_completion_tokens_total"):
            totals[name] = totals.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return totals


@pytest.mark.parametrize(
    ("scenario", "stream"),
    [("negative", False), ("negative-stream", True), ("hugecount", False)],
    ids=["negative-whole", "negative-streamed", "too-large"],
)
def test_token_counts_no_request_can_have_are_not_counted(
    gw: ManagedProcess, scenario: str, stream: bool
) -> None:
    before = token_totals(gw)
    answer = ask(gw, f"{scenario} A", stream=stream)
    assert answer.status_code == 200, answer.text
    assert "[DONE]" in answer.text if stream else content_of(answer) == "A"
    assert token_totals(gw) == before  # no counter went backwards (nor forwards)
    assert "Traceback" not in gw.logs()
    assert ask(gw, "ok B").status_code == 200


def metric(gw: ManagedProcess, name: str, *labels: str) -> float:
    total = 0.0
    for line in httpx.get(gw.url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + "{") and all(label in line for label in labels):
            total += float(line.rsplit(" ", 1)[1])
    return total


def data_events(text: str) -> list[str]:
    return [e[len("data: ") :] for e in text.split("\n\n") if e.startswith("data: ")]


@pytest.mark.parametrize("scenario", ["after-done", "after-done-later", "done-silent"])
def test_a_stream_ends_at_done_whatever_the_worker_sends_after_it(
    gw: ManagedProcess, scenario: str
) -> None:
    """Nothing after [DONE] is relayed, and the client's stream ends there at once (the worker
    keeps its response open: the gateway does not wait for it); data after it is counted, the
    worker is not blamed and the connection not reused."""
    after = "dflash_gateway_upstream_violations_total"
    before = metric(gw, after, 'kind="data_after_done"')
    broken = metric(gw, "dflash_gateway_upstream_attempts_total", 'outcome="ok"')
    answer = ask(gw, f"{scenario} A", stream=True)
    assert answer.status_code == 200
    events = data_events(answer.text)
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    assert "INJECTED" not in answer.text and "error" not in answer.text
    assert [orjson.loads(e)["choices"][0]["delta"]["content"] for e in events[:-1]] == ["A"]
    counted = metric(gw, after, 'kind="data_after_done"') - before
    if scenario == "after-done-later":  # it comes after the client's stream ended
        poll(lambda: metric(gw, after, 'kind="data_after_done"') - before == 1)
    else:
        assert counted == (1 if scenario == "after-done" else 0)
    assert metric(gw, "dflash_gateway_upstream_attempts_total", 'outcome="ok"') == broken + 1
    assert content_of(ask(gw, "ok B")) == "B"  # its connection was not reused


def ask_messages(gw: ManagedProcess, text: str, **extra: Any) -> httpx.Response:
    body = {"model": MODEL, "max_tokens": 16, "messages": [{"role": "user", "content": text}]}
    return httpx.post(gw.url + "/v1/messages", json=body | extra, timeout=30)


def test_a_messages_stream_ends_at_message_stop(gw: ManagedProcess) -> None:
    answer = ask_messages(gw, "after-done A", stream=True)
    assert answer.status_code == 200
    names = [e.split("\n", 1)[0] for e in answer.text.split("\n\n") if e]
    assert names[-1] == "event: message_stop" and names.count("event: message_stop") == 1
    assert "INJECTED" not in answer.text and "event: error" not in answer.text


@pytest.mark.parametrize("scenario", ["bad-choices", "bad-message"])
def test_a_malformed_worker_answer_on_the_messages_route_is_a_502(
    gw: ManagedProcess, scenario: str
) -> None:
    """Before the first event: a broken worker's answer, retried (no other worker here: 502),
    its breaker told; never a 500."""
    failed = metric(gw, "dflash_gateway_upstream_attempts_total", 'outcome="broken"')
    answer = ask_messages(gw, f"{scenario} A", stream=scenario == "bad-choices")
    assert answer.status_code == 502, answer.text
    assert answer.json() == {
        "type": "error",
        "error": {"type": "api_error", "message": "a worker sent an invalid response"},
    }
    assert metric(gw, "dflash_gateway_upstream_attempts_total", 'outcome="broken"') == failed + 1
    assert "Traceback" not in gw.logs()


def test_a_malformed_chunk_after_the_first_is_an_in_band_error(gw: ManagedProcess) -> None:
    failed = metric(gw, "dflash_gateway_upstream_attempts_total", 'outcome="broken"')
    answer = ask_messages(gw, "bad-function A", stream=True)
    assert answer.status_code == 200
    last = [e for e in answer.text.split("\n\n") if e][-1]
    assert last.startswith("event: error\n")
    assert orjson.loads(last.split("data: ", 1)[1])["error"]["type"] == "api_error"
    assert metric(gw, "dflash_gateway_upstream_attempts_total", 'outcome="broken"') == failed + 1
    assert "Traceback" not in gw.logs()


def test_a_model_name_cannot_forge_an_access_line(gw: ManagedProcess) -> None:
    forged = "2026-12-04 17:00:00,000 INFO dflash_gateway.access: request request_id=forged"
    for control in ("\n", "\r\n", "\u2028"):
        body = {"model": f"nope{control}{forged}", "messages": [{"role": "user", "content": "x"}]}
        answer = httpx.post(gw.url + CHAT, json=body, timeout=30)
        assert answer.status_code == 404
    poll(lambda: "nope\\x0a2026" in gw.logs())
    assert not [line for line in gw.logs().splitlines() if line.startswith(forged[:23])]
