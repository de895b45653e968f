"""The chat stream → Responses events translator (``app.responses.stream``), fed worker bytes:
the events are the openai SDK's own types, numbered without gaps, whatever the reads' sizes, and
a namespaced call, a cut answer and a failure come out as the API has them."""

from __future__ import annotations

import random
import re
from typing import Any

import orjson
import pydantic
import pytest
from openai.types.responses import ResponseStreamEvent

from app.errors import UpstreamBadResponse, UpstreamError, UpstreamTimeout
from app.responses.response import Context
from app.responses.stream import ResponsesStream

EVENTS: pydantic.TypeAdapter[Any] = pydantic.TypeAdapter(ResponseStreamEvent)
BASE = {"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "m"}


def sse(delta: dict[str, Any], finish: str | None = None) -> bytes:
    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
    choice["matched_stop"] = None
    return b"data: " + orjson.dumps({**BASE, "choices": [choice]}) + b"\n\n"


USAGE = b"data: " + orjson.dumps({**BASE, "choices": [], "usage": {
    "prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12,
    "prompt_tokens_details": {"cached_tokens": 3}, "reasoning_tokens": 2}}) + b"\n\n"  # fmt: skip
WORKER = [
    sse({"role": "assistant", "content": ""}),
    sse({"reasoning_content": "Let me "}),
    sse({"reasoning_content": 'think "hard"'}),
    sse({"content": "Hel"}),
    sse({"content": "lo\n"}),
    sse({"tool_calls": [{"index": 0, "id": "functions.agents.spawn:0", "type": "function",
                         "function": {"name": "agents.spawn", "arguments": ""}}]}),
    sse({"tool_calls": [{"index": 0, "function": {"arguments": '{"task":'}}]}),
    sse({"tool_calls": [{"index": 0, "function": {"arguments": ' "x"}'}}]}),
    sse({}, "tool_calls"),
    USAGE,
    b"data: [DONE]\n\n",
]  # fmt: skip


def context(**kw: Any) -> Context:
    names = {"agents.spawn": ("agents", "spawn")}
    return Context("kimi", {"metadata": {"a": "b"}}, names, kw.pop("summary", False), **kw)


def events(data: bytes, start: int = 0) -> list[Any]:
    out = []
    for block in data.split(b"\n\n"):
        if block:
            name, _, payload = block.partition(b"\ndata: ")
            event = EVENTS.validate_python(orjson.loads(payload))
            assert name == b"event: " + event.type.encode()
            out.append(event)
    assert [e.sequence_number for e in out] == list(range(start, start + len(out)))
    return out


@pytest.mark.parametrize("size", [1, 7, 64, 100_000])
def test_the_grammar_whatever_the_reads(size: int) -> None:
    raw = b"".join(WORKER)
    stream = ResponsesStream(context())
    out = b"".join(stream.feed(raw[i : i + size]) for i in range(0, len(raw), size))
    out += stream.finish()
    got = events(out)
    assert stream.done and stream.first_data and not stream.inband_error
    kinds = [e.type for e in got]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds.count("response.reasoning_text.delta") == 2
    assert kinds.count("response.output_text.delta") == 2
    assert kinds.count("response.function_call_arguments.delta") == 2
    final = got[-1]
    assert final.type == "response.completed" and final.response.status == "completed"
    reasoning, message, call = final.response.output
    assert reasoning.content[0].text == 'Let me think "hard"'
    assert message.content[0].text == "Hello\n"
    assert (call.name, call.namespace) == ("spawn", "agents")
    assert call.call_id == "functions.agents.spawn:0"
    assert call.arguments == '{"task": "x"}'
    usage = final.response.usage
    assert (usage.input_tokens, usage.output_tokens, usage.total_tokens) == (5, 7, 12)
    assert usage.input_tokens_details.cached_tokens == 3
    assert usage.output_tokens_details.reasoning_tokens == 2
    assert final.response.metadata == {"a": "b"} and final.response.model == "kimi"
    assert stream.usage is not None and stream.usage.completion_tokens == 7


def custom_call(*arguments: str) -> list[bytes]:
    head = {"index": 0, "id": "functions.apply_patch:0", "type": "function",
            "function": {"name": "apply_patch", "arguments": ""}}  # fmt: skip
    pieces = [{"index": 0, "function": {"arguments": piece}} for piece in arguments]
    return [
        sse({"role": "assistant", "content": ""}),
        sse({"tool_calls": [head]}),
        *[sse({"tool_calls": [piece]}) for piece in pieces],
        sse({}, "tool_calls"),
        USAGE,
        b"data: [DONE]\n\n",
    ]


@pytest.mark.parametrize(
    ("arguments", "expected", "deltas"),
    [
        (['{"inp', 'ut": "*** Begin Patch\\n', "caf\\u00e", '9 \\"q\\"', '"}'],
         '*** Begin Patch\ncaf\u00e9 "q"', 3),  # decoded as it comes, escapes whole
        (['{"input": "a\\ud83d', '\\ude00b"}'], "a\U0001f600b", 2),  # a surrogate pair split
        (['{"input": "\\ud800"}'], "\ufffd", 1),  # a lone surrogate
        (['{"input": "cut sho', "rt"], "cut short", 2),  # never closed: as far as it goes
        (['{"x": 1, "input": "y"}'], "y", 1),
        (["not ", "json"], "not json", 1),  # arguments the model got wrong: passed on as written
        ([], "", 0),
    ],
)  # fmt: skip
def test_a_custom_tools_call_is_a_custom_tool_call_with_its_input(
    arguments: list[str], expected: str, deltas: int
) -> None:
    stream = ResponsesStream(context(custom=frozenset({"apply_patch"})))
    got = events(b"".join(stream.feed(chunk) for chunk in custom_call(*arguments)))
    kinds = [e.type for e in got]
    assert not [kind for kind in kinds if kind.startswith("response.function_call")]
    added = next(e for e in got if e.type == "response.output_item.added")
    assert added.item.type == "custom_tool_call" and added.item.input == ""
    pieces = [e.delta for e in got if e.type == "response.custom_tool_call_input.delta"]
    done = next(e for e in got if e.type == "response.custom_tool_call_input.done")
    assert "".join(pieces) == done.input == expected and len(pieces) == deltas
    call = got[-1].response.output[0]
    assert (call.type, call.name, call.input) == ("custom_tool_call", "apply_patch", expected)
    assert call.call_id == "functions.apply_patch:0" and call.id == added.item.id == done.item_id
    assert call.status == "completed"


def test_summary_mode_and_a_cut_answer_is_incomplete() -> None:
    stream = ResponsesStream(context(summary=True))
    worker = [*WORKER[:4], sse({}, "length"), b"data: [DONE]\n\n"]
    got = events(b"".join(stream.feed(chunk) for chunk in worker))
    kinds = [e.type for e in got]
    assert "response.reasoning_summary_text.delta" in kinds
    assert "response.reasoning_text.delta" not in kinds
    final = got[-1]
    assert final.type == "response.incomplete"
    assert final.response.incomplete_details.reason == "max_output_tokens"
    assert final.response.output[0].summary[0].text == 'Let me think "hard"'
    assert final.response.output[-1].status == "incomplete"


def test_a_failure_after_the_start_is_response_failed_and_nothing_after_the_end() -> None:
    stream = ResponsesStream(context())
    first = stream.feed(b"".join(WORKER[:3]))
    failed = stream.fail(UpstreamTimeout("idle"))
    got = events(first + failed)
    assert got[-1].type == "response.failed"
    assert got[-1].response.error.code == "server_error"
    assert got[-1].response.output == []  # the open reasoning item never completed
    done = ResponsesStream(context())
    done.feed(b"".join(WORKER))
    assert done.fail(UpstreamTimeout("late")) == b""


def test_nothing_follows_a_workers_error_event() -> None:
    stream = ResponsesStream(context())
    error = b'data: {"error": {"message": "boom", "code": 500}}\n\n'
    out = b"".join(stream.feed(c) for c in [*WORKER[:3], error, WORKER[2], WORKER[3]])
    out += stream.feed(b"data: [DONE]\n\n")
    got = events(out)
    assert got[-1].type == "response.failed" and stream.inband_error and stream.done


def test_fail_before_any_event_still_opens_the_response() -> None:
    got = events(ResponsesStream(context()).fail(UpstreamTimeout("no first byte")))
    assert [e.type for e in got] == ["response.created", "response.in_progress", "response.failed"]


@pytest.mark.parametrize(
    "bad",
    [
        b'data: {"choices": "x"}\n\n',
        b'data: {"choices": [3]}\n\n',
        b'data: {"choices": [{"delta": {"content": 5}}]}\n\n',
        b'data: {"choices": [{"delta": {"tool_calls": {"a": 1}}}]}\n\n',
        b'data: {"choices": [{"delta": {"tool_calls": [{"index": "0"}]}}]}\n\n',
        b"data: [1, 2]\n\n",
        b"data: {nope\n\n",
        b"data: [DONE]\n\n",
    ],
)
def test_a_broken_worker_event_is_upstream_bad_response_and_writes_nothing(bad: bytes) -> None:
    stream = ResponsesStream(context())
    with pytest.raises(UpstreamBadResponse):
        stream.feed(bad)
    assert not stream.first_data  # before the commit point: the attempt may be retried
    started = ResponsesStream(context())
    head = started.feed(b"".join(WORKER[:2]))
    if bad != b"data: [DONE]\n\n":
        middle = started.feed(WORKER[2] + bad)  # the good event of the read goes out whole
        with pytest.raises(UpstreamBadResponse):
            started.finish()  # the failure with the stream's end (or its next read)
        tail = started.fail(UpstreamBadResponse("broken"))
        got = events(head + middle + tail)
        assert [e.type for e in got][-2:] == ["response.reasoning_text.delta", "response.failed"]


def test_a_quick_delta_that_is_not_one_string_is_parsed_whole() -> None:
    stream = ResponsesStream(context())
    before = len(events(stream.feed(b"".join(WORKER[:2]))))
    forged = (
        b'data: {"id":"c","choices":[{"index":0,"delta":{"reasoning_content":"a","content":"b'
        b'"},"logprobs":null,"finish_reason":null,"matched_stop":null}]}\n\n'
    )
    got = events(stream.feed(forged), before)
    kinds = [e.type for e in got]
    # Both deltas, as the parsed event holds them: the reasoning, then a new message item.
    assert kinds[0] == "response.reasoning_text.delta" and "response.output_text.delta" in kinds


def delta_event(key: str, literal: bytes) -> bytes:
    """A worker's delta event in SGLang's own layout, its value ``literal`` as it is (any
    bytes: a worker's JSON string, or something that only looks like one)."""
    head = b"data: " + orjson.dumps({**BASE, "choices": [{"index": 0, "delta": {key: 0}}]})
    return (
        head.partition(b":0}")[0]
        + b":"
        + literal
        + (b'},"logprobs":null,"finish_reason":null,"matched_stop":null}]}\n\n')
    )


TEXTS = ["a", "bc ", " ", "\n", '"', "\\", "é", "日本", "😀", "\u2028", "\x01", "/", ""]
FORGED = [
    b"1", b"null", b'"a","b"', b' "a"', b'"a" ', b'"\\ud800"', b'"\xff"', b'"\xc3', b'\xa9"',
    b'"a\nb"', b'\n"a"', b'"a"\n\n"b"', b'["a"]', b'{"x":1}', b'"a"],["b"',
    b'"\\u00e9"', b'""', b'"a\\"', b'"\\\\"',
]  # fmt: skip
OTHERS = [
    WORKER[0], WORKER[5], WORKER[6], WORKER[8], USAGE, b"data: [DONE]\n\n",
    b": keep-alive\n\n", b"data: {nope\n\n", b'data: {"error": {"message": "boom"}}\n\n',
    sse({"reasoning_content": "x", "content": "y"}), sse({"content": None}, "stop"),
]  # fmt: skip


def worker_events(rng: random.Random) -> list[bytes]:
    out = []
    for _ in range(rng.randrange(1, 60)):
        roll = rng.random()
        key = rng.choice(["reasoning_content", "content"])
        if roll < 0.8:
            text = "".join(rng.choice(TEXTS) for _ in range(rng.randrange(0, 4)))
            out.append(delta_event(key, orjson.dumps(text)))
        elif roll < 0.9:
            out.append(delta_event(key, rng.choice(FORGED)))
        else:
            out.append(rng.choice(OTHERS))
    return out


def outcome(reads: list[bytes]) -> tuple[Any, ...]:
    stream = ResponsesStream(context(id="resp_" + "0" * 32, created_at=1))
    out, error = [], None
    try:
        for read in reads:
            out.append(stream.feed(read))
        out.append(stream.finish())
    except UpstreamError as exc:
        error = (type(exc), str(exc))
    text = re.sub(rb'"completed_at":\d+', b'"completed_at":0', b"".join(out))  # the clock's
    return text, error, stream.events, stream.done, stream.after_done, stream.usage


@pytest.mark.parametrize("seed", range(300))
def test_a_read_of_many_events_is_translated_as_they_are_one_by_one(seed: int) -> None:
    # At saturation a whole stream arrives in one read (the run of common deltas is translated
    # in one pass): the client gets the same bytes and the same failures as event by event.
    rng = random.Random(seed)
    rest = worker_events(rng)
    data = b"".join(rest)
    cuts = sorted(rng.sample(range(len(data) + 1), min(3, len(data) + 1)))
    pieces = [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True)]
    one_by_one = outcome([WORKER[0], *rest])
    assert outcome([WORKER[0], data]) == one_by_one
    assert outcome([WORKER[0], *pieces]) == one_by_one


@pytest.mark.parametrize("seed", range(4))
def test_a_long_run_in_one_read_is_translated_as_event_by_event(seed: int) -> None:
    # Longer than the bytes a run looks at in one go; a forged literal somewhere in it.
    rng = random.Random(seed)
    texts = ["".join(rng.choice(TEXTS) for _ in range(rng.randrange(1, 6))) for _ in range(1500)]
    rest = [delta_event("content", orjson.dumps(text)) for text in texts]
    rest.insert(rng.randrange(len(rest)), delta_event("content", rng.choice(FORGED)))
    rest += [sse({}, "stop"), USAGE, b"data: [DONE]\n\n"]
    assert outcome([WORKER[0], b"".join(rest)]) == outcome([WORKER[0], *rest])
