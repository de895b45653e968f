"""``/v1/responses`` in front of a misbehaving worker, and with hostile input: a real gateway
process in front of a fake worker (``tests.e2e.test_hostile_worker``'s, answering each completion
the way its request's text names). A broken worker is a 502 in OpenAI's shape before the stream
began and a typed ``response.failed`` after it; hostile input is a 4xx. Never a 500."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pydantic
import pytest
from openai.types.responses import ResponseStreamEvent

from tests.e2e import test_hostile_worker as hostile
from tests.e2e.conftest import gateway
from tests.support.procs import ManagedProcess, managed_processes

pytestmark = pytest.mark.processes

MODEL = hostile.MODEL
EVENTS: pydantic.TypeAdapter[Any] = pydantic.TypeAdapter(ResponseStreamEvent)


# The rid of the request being answered: SGLang answers with it as the id, which the gateway checks.
RID = ["c"]


def chunk(delta: Any = None, **choice: Any) -> bytes:
    body = {"id": RID[0], "object": "chat.completion.chunk", "choices": [{"index": 0, **choice}]}
    if delta is not None:
        body["choices"][0]["delta"] = delta
    return b"data: " + orjson.dumps(body) + b"\n\n"


def raw(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


DONE = b"data: [DONE]\n\n"
PAUSE = b"\x00pause\x00"  # the worker flushes what came before and waits a moment


def paused(*events: bytes) -> bytes:
    """A stream whose first event reaches the gateway alone (its commit point passes), the rest
    after a pause."""
    first, rest = hostile.stream(*events[:1]), hostile.stream(*events[1:])
    head_end = first.index(b"\r\n\r\n") + 4
    return first[:-5] + PAUSE + rest[head_end:]


def good() -> bytes:
    return chunk({"role": "assistant", "content": "Hel"})


def usage() -> bytes:
    return raw({"id": RID[0], "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2}})


SCENARIOS = {
    "ok": lambda tag: hostile.stream(good(), chunk({"content": "lo"}, finish_reason="stop"),
                                     usage(), DONE),
    "badchoices": lambda tag: hostile.stream(raw({"id": RID[0], "choices": "nope"}), DONE),
    "baddelta": lambda tag: hostile.stream(chunk([1, 2]), DONE),
    "donefirst": lambda tag: hostile.stream(DONE),
    "badcall": lambda tag: paused(good(), chunk({"tool_calls": [7]}), DONE),
    "badname": lambda tag: paused(
        good(), chunk({"tool_calls": [{"index": 0, "function": {"name": {"x": 1}}}]}), DONE
    ),
    "inband": lambda tag: paused(good(), raw({"error": {"message": "boom", "code": 500}}), DONE),
    "cut": lambda tag: paused(good()),
    "notjson": lambda tag: paused(good(), b"data: {not json\n\n", DONE),
    "whole-bad": lambda tag: hostile.response(orjson.dumps({"choices": [{"message": "x"}]})),
    "whole-ok": lambda tag: hostile.response(hostile.completion("fine", rid=RID[0])),
    # The stream's head, then nothing: keep-alives, then the idle deadline.
    "silent": lambda tag: hostile.stream()[: -len(b"0\r\n\r\n")],
}  # fmt: skip


class Worker(hostile.FakeWorker):
    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        real = writer.write

        def write(data: bytes) -> None:
            parts = data.split(PAUSE)
            real(parts[0])
            if len(parts) > 1:
                later = asyncio.get_running_loop().call_later
                later(0.3, real, b"".join(parts[1:]))

        writer.write = write  # type: ignore[method-assign]
        await super()._serve(reader, writer)

    def _answer(self, path: str, body: bytes) -> bytes:
        if path == hostile.CHAT:
            request = orjson.loads(body)
            RID[0] = request["rid"]
            text = request["messages"][-1]["content"]
            scenario, _, tag = text.partition(" ")
            return SCENARIOS[scenario](tag)
        return super()._answer(path, body)


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ManagedProcess]:
    with Worker() as worker, managed_processes(tmp_path_factory, "responses-hostile") as manager:
        env = {
            "DFLASH_GATEWAY_BREAKER__FAILURE_THRESHOLD": "1000",
            "DFLASH_GATEWAY_TIMEOUTS__KEEPALIVE_S": "0.2",
            "DFLASH_GATEWAY_TIMEOUTS__IDLE_S": "1.5",
        }
        yield gateway(manager, [worker.url], env=env)


def post(gw: ManagedProcess, body: Any, **kw: Any) -> httpx.Response:
    content = body if isinstance(body, bytes) else orjson.dumps(body)
    headers = {"content-type": "application/json"}
    return httpx.post(gw.url + "/v1/responses", content=content, headers=headers, timeout=30, **kw)


def events_of(response: httpx.Response) -> list[Any]:
    assert response.status_code == 200, response.text
    events = []
    for block in response.text.split("\n\n"):
        for line in block.split("\n"):
            if line.startswith("data: "):
                events.append(EVENTS.validate_python(json.loads(line[6:])))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    return events


def test_a_good_stream_completes(gw: ManagedProcess) -> None:
    events = events_of(post(gw, {"model": MODEL, "input": "ok", "stream": True}))
    assert events[-1].type == "response.completed"
    assert events[-1].response.output[0].content[0].text == "Hello"
    assert events[-1].response.usage.output_tokens == 2


@pytest.mark.parametrize("scenario", ["badchoices", "baddelta", "donefirst"])
def test_a_broken_worker_before_the_first_event_is_a_502(gw: ManagedProcess, scenario: str) -> None:
    response = post(gw, {"model": MODEL, "input": scenario, "stream": True})
    assert response.status_code == 502
    assert response.json()["error"]["code"] == "bad_upstream_response"


@pytest.mark.parametrize("scenario", ["badcall", "badname", "inband", "cut", "notjson"])
def test_a_broken_worker_after_the_first_event_ends_with_response_failed(
    gw: ManagedProcess, scenario: str
) -> None:
    events = events_of(post(gw, {"model": MODEL, "input": scenario, "stream": True}))
    assert events[0].type == "response.created"
    assert events[-1].type == "response.failed"
    failed = events[-1].response
    assert failed.status == "failed" and failed.error.code == "server_error"
    assert failed.id == events[0].response.id


def test_keepalives_then_a_timeout_still_open_the_response_before_failing_it(
    gw: ManagedProcess,
) -> None:
    response = post(gw, {"model": MODEL, "input": "silent", "stream": True})
    assert response.text.startswith(": keep-alive\n\n")  # a comment every SSE client skips
    kinds = [e.type for e in events_of(response)]
    assert kinds == ["response.created", "response.in_progress", "response.failed"]


def test_whole_answers(gw: ManagedProcess) -> None:
    good = post(gw, {"model": MODEL, "input": "whole-ok"})
    assert good.status_code == 200 and good.json()["output"][0]["content"][0]["text"] == "fine"
    bad = post(gw, {"model": MODEL, "input": "whole-bad"})
    assert bad.status_code == 502 and bad.json()["error"]["code"] == "bad_upstream_response"


def _deep(depth: int) -> Any:
    value: Any = {}
    for _ in range(depth):
        value = {"a": value}
    return value


@pytest.mark.parametrize(
    "body",
    [
        b"[]",
        b"{nope",
        b'{"model": "m", "input": ' + b"[" * 5000 + b"]" * 5000 + b"}",
        orjson.dumps({"model": MODEL, "input": "ok", "metadata": _deep(200)}),
        orjson.dumps({"model": MODEL, "input": "ok", "tools": [{"type": "function", "name": "f",
                      "parameters": _deep(100)}]}),
        b'{"model":"m","input":[' + b",".join([b"{}"] * 400_000) + b"]}",
        orjson.dumps({"model": MODEL, "input": [{"type": "computer_call_output"}]}),
        orjson.dumps({"model": MODEL, "input": [{"type": "message", "role": "tool",
                      "content": "x"}]}),
        orjson.dumps({"model": MODEL, "input": [{"role": "user", "content": [{"type": "video"}]}]}),
        orjson.dumps({"model": MODEL, "input": 7}),
        orjson.dumps({"model": MODEL, "input": "ok", "tool_choice": {"type": "function",
                      "name": "missing"}}),
        orjson.dumps({"model": MODEL, "input": "ok", "reasoning": {"effort": "extreme"}}),
        orjson.dumps({"model": MODEL, "input": "ok", "max_output_tokens": 0}),
    ],
)  # fmt: skip
def test_hostile_input_is_a_4xx(gw: ManagedProcess, body: bytes) -> None:
    response = post(gw, body)
    assert 400 <= response.status_code < 500, response.text
    assert response.json()["error"]["type"] == "invalid_request_error"


def test_a_recursive_schema_is_passed_on_not_expanded(gw: ManagedProcess) -> None:
    node = {"type": "object", "properties": {"child": {"$ref": "#"}}}
    tool = {"type": "function", "name": "tree", "parameters": node}
    response = post(gw, {"model": MODEL, "input": "whole-ok", "tools": [tool]})
    assert response.status_code == 200
