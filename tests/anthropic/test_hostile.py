"""Hostile input on the Messages surface, both ways: client bodies that used to cost hundreds of
MiB or end in a 500 (unhashable names, deep nesting), and worker chunks and answers of any shape.
Whatever comes in, the translators give a translation or the gateway's own error, never another
exception (hypothesis mutates valid bodies and chunks)."""

from __future__ import annotations

import copy
import tracemalloc
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from app.anthropic.request import MAX_DEPTH, SIZE_FACTOR, SIZE_SLACK, load, translate
from app.anthropic.response import to_message
from app.anthropic.stream import MessagesStream
from app.errors import InvalidRequest, UpstreamError
from tests.support.gateway import MODEL, FakeWorker, GatewayHarness

BODY: dict[str, Any] = {
    "model": MODEL,
    "max_tokens": 64,
    "system": [{"type": "text", "text": "Be brief."}],
    "messages": [
        {"role": "user", "content": [{"type": "text", "text": "Read a.md"}]},
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "I should read it.", "signature": ""},
                {"type": "tool_use", "id": "t1", "name": "read", "input": {"path": "a.md"}},
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "t1", "content": "# A"},
                {"type": "text", "text": "Summarise it."},
            ],
        },
    ],
    "tools": [{"name": "read", "input_schema": {"type": "object", "properties": {}}}],
    "tool_choice": {"type": "tool", "name": "read"},
    "thinking": {"type": "enabled", "budget_tokens": 1024},
    "stop_sequences": ["END"],
    "stream": True,
}


def nested(depth: int) -> bytes:
    """An object nested ``depth`` levels deep, as JSON (orjson writes 254 levels at most)."""
    return b'{"a":' * depth + b"{}" + b"}" * depth


def with_raw(body: dict[str, Any], *where: Any, value: bytes) -> bytes:
    """``body`` as JSON with ``value`` (raw JSON) at ``where``."""
    doc = copy.deepcopy(body)
    parent = doc
    for step in where[:-1]:
        parent = parent[step]
    parent[where[-1]] = "@@RAW@@"
    return orjson.dumps(doc).replace(b'"@@RAW@@"', value)


def hostile_bodies() -> dict[str, tuple[bytes, str]]:
    """Bodies that used to end in a 500, and the field their 400 names."""
    return {
        "unhashable-tool-choice-name": (
            with_raw(BODY, "tool_choice", "name", value=b"{}"),
            "tool_choice.name",
        ),
        "input-schema-300-deep": (
            with_raw(BODY, "tools", 0, "input_schema", "properties", value=nested(300)),
            "tools.0.input_schema",
        ),
        "tool-use-input-990-deep": (
            with_raw(BODY, "messages", 1, "content", 1, "input", value=nested(990)),
            "messages.1.content.1.input",
        ),
    }


@pytest.mark.parametrize("name", list(hostile_bodies()))
def test_a_hostile_body_is_a_400_naming_its_field(name: str) -> None:
    raw, field = hostile_bodies()[name]
    with pytest.raises(InvalidRequest) as info:
        translate(load(raw), max_messages=100)
    assert info.value.status == 400
    assert info.value.message.startswith(field), info.value.message


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages/count_tokens"])
async def test_hostile_bodies_are_400s_from_the_gateway(path: str) -> None:
    async with GatewayHarness([FakeWorker()]) as gw:
        for name, (raw, field) in hostile_bodies().items():
            ex = await gw.request("POST", path, raw=raw)
            assert ex.status == 400, (name, ex.body)
            error = orjson.loads(ex.body)["error"]
            assert error["type"] == "invalid_request_error"
            assert error["message"].startswith(field), error["message"]


def test_deep_but_allowed_nesting_passes() -> None:
    raw = with_raw(BODY, "tools", 0, "input_schema", "properties", value=nested(MAX_DEPTH - 6))
    chat = translate(load(raw), max_messages=100).chat
    orjson.dumps(chat)  # the chat body the proxy sends is writable


# Item: bodies are decoded within SIZE_FACTOR times their size.

EIGHT_MIB = 8 * 1024 * 1024


def many(item: bytes) -> bytes:
    n = EIGHT_MIB // (len(item) + 1)
    head = b'{"model":"m","max_tokens":1,"messages":[{"role":"user","content":['
    return head + b",".join([item] * n) + b"]}]}"


def peak_of(raw: bytes) -> tuple[int, Exception | None]:
    tracemalloc.start()
    try:
        body = load(raw)
        error = None
    except InvalidRequest as exc:
        body, error = None, exc
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    del body
    return peak, error


@pytest.mark.parametrize("item", [b"{}", b"[]", b'"a"', b"1.5", b'{"a":1}'])
def test_a_body_of_many_tiny_values_is_refused_before_it_is_decoded(item: bytes) -> None:
    raw = many(item)
    peak, error = peak_of(raw)
    assert isinstance(error, InvalidRequest) and "too many JSON values" in error.message
    assert peak < len(raw)  # nothing was decoded (was +259 MiB for {} objects)


def test_a_large_ordinary_body_is_decoded_within_the_bound() -> None:
    raw = many(b'{"type":"text","text":"' + b"x" * 200 + b'"}')
    peak, error = peak_of(raw)
    assert error is None
    assert peak <= SIZE_FACTOR * len(raw) + SIZE_SLACK


# Fuzzing: mutated valid bodies give a translation or InvalidRequest, nothing else.

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner),
    max_leaves=12,
)


def paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix]
    if isinstance(value, dict):
        for key, item in value.items():
            out += paths(item, (*prefix, key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            out += paths(item, (*prefix, i))
    return out


def mutate(doc: Any, data: st.DataObject) -> Any:
    doc = copy.deepcopy(doc)
    for _ in range(data.draw(st.integers(1, 3))):
        where = data.draw(st.sampled_from(paths(doc)))
        replacement = data.draw(JSON)
        if not where:
            return replacement
        parent = doc
        for step in where[:-1]:
            parent = parent[step]
        if data.draw(st.booleans()) and isinstance(parent, dict):
            del parent[where[-1]]
        else:
            parent[where[-1]] = replacement
    return doc


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_fuzz_the_translator_with_mutated_bodies(data: st.DataObject) -> None:
    body = mutate(BODY, data)
    count_only = data.draw(st.booleans())
    try:
        raw = orjson.dumps(body)
    except orjson.JSONEncodeError:  # a number JSON cannot carry (a NaN): not a request body
        return
    try:
        translated = translate(load(raw), max_messages=100, count_only=count_only)
    except InvalidRequest:
        return
    orjson.dumps(translated.chat)


CHUNKS = [
    {"id": "R", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": d}]}
    for d in (
        {"role": "assistant", "content": ""},
        {"reasoning_content": "hm"},
        {"content": "Hi"},
        {"tool_calls": [{"index": 0, "id": "f:0", "type": "function", "function": {"name": "f"}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"a": 1}'}}]},
    )
] + [
    {"id": "R", "choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]},
    {"id": "R", "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 4}},
]


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_fuzz_the_stream_translator_with_hostile_chunks(data: st.DataObject) -> None:
    stream = MessagesStream("kimi")
    stream.expect = data.draw(st.sampled_from([None, "R"]))
    chunks = mutate(CHUNKS, data)
    if not isinstance(chunks, list):
        chunks = [chunks]
    try:
        wire = b"".join(b"data: " + orjson.dumps(c) + b"\n\n" for c in chunks)
    except orjson.JSONEncodeError:
        return
    cut = data.draw(st.integers(0, len(wire)))
    try:
        out = stream.feed(wire[:cut]) + stream.feed(wire[cut:] + b"data: [DONE]\n\n")
        out += stream.finish()
    except UpstreamError:
        return
    assert isinstance(out, bytes)


ANSWER = {
    "id": "R",
    "object": "chat.completion",
    "choices": [
        {
            "index": 0,
            "message": {
                "role": "assistant",
                "content": "Hi",
                "reasoning_content": "hm",
                "tool_calls": [
                    {"id": "f:0", "type": "function", "function": {"name": "f", "arguments": "{}"}}
                ],
            },
            "finish_reason": "stop",
            "matched_stop": "END",
        }
    ],
    "usage": {"prompt_tokens": 3, "completion_tokens": 4},
}


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_fuzz_the_answer_translator_with_hostile_answers(data: st.DataObject) -> None:
    doc = mutate(ANSWER, data)
    if not isinstance(doc, dict):
        return  # the relay refuses a non-object answer before translating it
    try:
        message = to_message(doc, "kimi")
    except UpstreamError:
        return
    orjson.dumps(message)


@pytest.mark.parametrize("arguments", ['{"a":' * 300 + "1" + "}" * 300, "1", '"x"', "[[]]"])
def test_any_tool_arguments_make_a_writable_message(arguments: str) -> None:
    doc = copy.deepcopy(ANSWER)
    doc["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"] = arguments
    orjson.dumps(to_message(doc, "kimi"))
