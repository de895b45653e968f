"""n > 1, batched prompts, logprobs and JSON-schema answers, checked against SGLang's own models
(sglang 0.5.23 wheel) and against the emulator's ground truth (one stats record per choice)."""

from __future__ import annotations

import re
import types
from collections import defaultdict
from typing import Any

import httpx
import orjson
import pytest

from tests.emulator import sglang_protocol
from tests.emulator.support import CHAT, stats, wait_for
from tests.emulator.test_fidelity import _raw_events, check_chat_stream
from tests.support.procs import PYTHON, ManagedProcess, ProcessManager

EMULATE = [PYTHON, "-m", "app", "emulate", "--port", "{port}", "--speed", "50"]
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "minLength": 3},
        "population": {"type": "integer", "minimum": 1000, "maximum": 5000},
        "tags": {"type": "array", "items": {"$ref": "#/$defs/tag"}, "minItems": 2},
        "capital": {"type": "boolean"},
        "kind": {"enum": ["town", "city"]},
        "area": {"anyOf": [{"type": "number", "exclusiveMinimum": 0}, {"type": "null"}]},
    },
    "required": ["city", "population"],
    "$defs": {"tag": {"type": "object", "properties": {"name": {"type": "string"}}}},
}


@pytest.fixture(scope="module")
def sg() -> tuple[types.ModuleType, types.ModuleType]:
    return sglang_protocol.load()


def _records(client: httpx.Client, count: int) -> list[dict[str, Any]]:
    """The ground truth of the last request's ``count`` choices, by choice index."""
    found: list[dict[str, Any]] = wait_for(
        lambda: (r := stats(client)["requests"]) and len(r) >= count and r[-count:],
        what=f"{count} records",
    )
    return sorted(found, key=lambda r: r["index"])


def _check_steps(record: dict[str, Any]) -> None:
    steps = record["tokens_per_step"]
    assert steps and all(1 <= t <= 8 for t in steps)
    assert sum(steps) == record["completion_tokens"]
    assert record["spec_accept_length"] == pytest.approx(sum(steps) / len(steps))


def test_chat_stream_n_interleaves_choices_with_logprobs(emu: ManagedProcess, sg: Any) -> None:
    body = {
        **CHAT,
        "n": 3,
        "temperature": 0.8,
        "max_tokens": 60,
        "logprobs": True,
        "top_logprobs": 2,
        "stream_options": {"include_usage": True},
    }
    with httpx.Client(base_url=emu.url, timeout=30) as client:
        chunks = check_chat_stream(sg, _raw_events(client, "/v1/chat/completions", body))
        records = _records(client, 3)
    usage = chunks[-1]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == sum(
        r["completion_tokens"] for r in records
    )
    finishes = chunks[-4:-1]
    assert sorted(c["choices"][0]["index"] for c in finishes) == [0, 1, 2]
    assert all(c["choices"][0]["finish_reason"] == "length" for c in finishes)
    # every finish chunk (and the usage chunk) carries the id of the last output, as SGLang's
    assert {c["id"] for c in finishes} == {usage["id"]} == {chunks[-5]["id"]}
    per_index: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for chunk in chunks[:-4]:
        per_index[chunk["choices"][0]["index"]].append(chunk)
    order = [c["choices"][0]["index"] for c in chunks[:-4]]
    assert order != sorted(order)  # interleaved, not one choice after another
    for index, record in enumerate(records):
        mine = per_index[index]
        assert record["index"] == index and record["stream"]
        assert {c["id"] for c in mine} == {record["rid"]}  # each choice has its own rid
        assert mine[0]["choices"][0]["delta"]["role"] == "assistant"
        _check_steps(record)
        tokens = [
            t
            for c in mine
            if c["choices"][0]["logprobs"]
            for t in c["choices"][0]["logprobs"]["content"]
        ]
        assert len(tokens) == record["completion_tokens"]  # every token, hidden ones too
        # one logprobs list per verify step
        assert sum(1 for c in mine if c["choices"][0]["logprobs"]) == record["steps"]
        for token in tokens:
            assert token["bytes"] == list(token["token"].encode())
            top = token["top_logprobs"]
            assert len(top) == 2 and top[0]["token"] == token["token"]
            assert top[0]["logprob"] == token["logprob"] > top[1]["logprob"]


def test_chat_response_n_with_logprobs_matches_sglang(emu: ManagedProcess, sg: Any) -> None:
    protocol, _ = sg
    body = {**CHAT, "n": 2, "max_tokens": 40, "logprobs": True, "return_meta_info": True}
    with httpx.Client(base_url=emu.url, timeout=30) as client:
        one = client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 40}).json()
        obj = client.post("/v1/chat/completions", json=body).json()
        records = _records(client, 2)
    assert protocol.ChatCompletionResponse.model_validate(obj).model_dump() == obj
    assert [c["index"] for c in obj["choices"]] == [0, 1]
    assert obj["id"] == records[0]["rid"]
    usage = obj["usage"]
    assert usage["prompt_tokens"] == one["usage"]["prompt_tokens"]  # the prompt counts once
    assert usage["completion_tokens"] == sum(r["completion_tokens"] for r in records)
    for choice, record in zip(obj["choices"], records, strict=True):
        _check_steps(record)
        assert choice["meta_info"]["id"] == record["rid"]
        assert choice["meta_info"]["spec_verify_ct"] == record["steps"]
        content = choice["logprobs"]["content"]
        assert len(content) == record["completion_tokens"]
        assert all(t["top_logprobs"] == [] and t["logprob"] <= 0 for t in content)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("n", [1, 2])
def test_completion_batch_order_ids_and_logprobs(
    emu: ManagedProcess, sg: Any, stream: bool, n: int
) -> None:
    protocol, _ = sg
    prompts: list[Any] = ["Write a haiku about rain", [101, 2023, 2003, 1037]]
    rid = f"batch-{n}-{int(stream)}"
    body = {"prompt": prompts, "n": n, "max_tokens": 24, "logprobs": 3, "rid": rid}
    with httpx.Client(base_url=emu.url, timeout=30) as client:
        if stream:
            body["stream_options"] = {"include_usage": True}
            raws = _raw_events(client, "/v1/completions", body)
            assert raws[-1] == "[DONE]"
            chunks = [protocol.CompletionStreamResponse.model_validate_json(r) for r in raws[:-2]]
            assert all(c.model_dump_json() == r for c, r in zip(chunks, raws, strict=False))
            usage = orjson.loads(raws[-2])["usage"]
            seen: dict[int, list[Any]] = defaultdict(list)
            for c in chunks:
                seen[c.choices[0].index].append(c)
            ids = {i: {c.id for c in cs} for i, cs in seen.items()}
            texts = {i: "".join(c.choices[0].text for c in cs) for i, cs in seen.items()}
            tokens = {
                i: sum(len(c.choices[0].logprobs.tokens) for c in cs) for i, cs in seen.items()
            }
        else:
            obj = client.post("/v1/completions", json=body).json()
            assert protocol.CompletionResponse.model_validate(obj).model_dump() == obj
            usage = obj["usage"]
            assert [c["index"] for c in obj["choices"]] == list(range(2 * n))
            ids = {}
            texts = {c["index"]: c["text"] for c in obj["choices"]}
            tokens = {c["index"]: len(c["logprobs"]["tokens"]) for c in obj["choices"]}
            for c in obj["choices"]:
                lp = c["logprobs"]
                assert lp["text_offset"] == [-1] * len(lp["tokens"])
                assert all(len(top) == 3 for top in lp["top_logprobs"])
        records = _records(client, 2 * n)
    assert sorted(texts) == list(range(2 * n))
    if n == 1:  # a batch keeps the caller's rid with a suffix; parallel samples get fresh ones
        assert [r["rid"] for r in records] == [f"{rid}_0", f"{rid}_1"]
    else:
        assert not any(r["rid"].startswith(rid) for r in records)
    for record in records:
        _check_steps(record)
        assert tokens[record["index"]] == record["completion_tokens"]
        if ids:
            assert ids[record["index"]] == {record["rid"]}
    # prompt-major: choices 0..n-1 answer the first prompt
    first_prompt = {r["prompt_tokens"] for r in records[:n]}
    second_prompt = {r["prompt_tokens"] for r in records[n:]}
    assert len(first_prompt) == len(second_prompt) == 1 and first_prompt != second_prompt
    assert usage["prompt_tokens"] == first_prompt.pop() + second_prompt.pop()
    assert usage["completion_tokens"] == sum(r["completion_tokens"] for r in records)


def _conforms(value: Any, schema: dict[str, Any], root: dict[str, Any]) -> bool:
    """Enough of JSON Schema validation for ``SCHEMA``."""
    if "$ref" in schema:
        return _conforms(value, root["$defs"][schema["$ref"].rsplit("/", 1)[1]], root)
    if "enum" in schema:
        return value in schema["enum"]
    if "anyOf" in schema:
        return any(_conforms(value, s, root) for s in schema["anyOf"])
    kind = schema.get("type")
    if kind == "object":
        props = schema.get("properties", {})
        return (
            isinstance(value, dict)
            and all(k in value for k in schema.get("required", []))
            and all(_conforms(v, props[k], root) for k, v in value.items() if k in props)
        )
    if kind == "array":
        return (
            isinstance(value, list)
            and len(value) >= schema.get("minItems", 0)
            and all(_conforms(v, schema["items"], root) for v in value)
        )
    if kind == "string":
        return isinstance(value, str) and len(value) >= schema.get("minLength", 0)
    if kind == "integer":
        low, high = schema.get("minimum", -(2**63)), schema.get("maximum", 2**63)
        return isinstance(value, int) and low <= value <= high
    if kind == "number":
        return isinstance(value, int | float) and value > schema.get("exclusiveMinimum", -1e308)
    if kind == "boolean":
        return isinstance(value, bool)
    return kind == "null" and value is None


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_answer_is_valid_json(emu: ManagedProcess, sg: Any, stream: bool) -> None:
    protocol, _ = sg
    fmt = {"type": "json_schema", "json_schema": {"name": "place", "schema": SCHEMA}}
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {}}}]
    body = {**CHAT, "response_format": fmt, "tools": tools, "max_tokens": 5000}
    with httpx.Client(base_url=emu.url, timeout=30) as client:
        if stream:
            chunks = check_chat_stream(sg, _raw_events(client, "/v1/chat/completions", body))
            deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
            content = "".join(d.get("content") or "" for d in deltas)
            reasoning = "".join(d.get("reasoning_content") or "" for d in deltas)
            finish = chunks[-1]["choices"][0]["finish_reason"]
            assert not any(d.get("tool_calls") for d in deltas)  # tool parsing is off
        else:
            obj = client.post("/v1/chat/completions", json=body).json()
            assert protocol.ChatCompletionResponse.model_validate(obj).model_dump() == obj
            message = obj["choices"][0]["message"]
            content, reasoning = message["content"], message["reasoning_content"]
            finish = obj["choices"][0]["finish_reason"]
            assert message.get("tool_calls") is None
        text = client.post(
            "/v1/completions",
            json={"prompt": "City data:", "response_format": {"type": "json_object"}},
        ).json()["choices"][0]["text"]
    assert reasoning  # the grammar applies after the reasoning
    assert finish == "stop"
    assert _conforms(orjson.loads(content), SCHEMA, SCHEMA)
    assert isinstance(orjson.loads(text), dict)


def test_regex_and_ebnf_answers_match_their_grammar(emu: ManagedProcess) -> None:
    regex = r"(yes|no), because [a-z]+ \d{2,4}\."
    ebnf = 'root ::= item ("," item)*\nitem ::= "[" [0-9]+ "]" | "none"'
    item = r"(\[[0-9]+\]|none)"
    with httpx.Client(base_url=emu.url, timeout=30) as client:
        for stream in (False, True):
            body = {**CHAT, "regex": regex, "max_tokens": 5000, "stream": stream}
            if stream:
                chunks = [
                    orjson.loads(r) for r in _raw_events(client, "/v1/chat/completions", body)[:-1]
                ]
                content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
            else:
                message = client.post("/v1/chat/completions", json=body).json()["choices"][0][
                    "message"
                ]
                content = message["content"]
                assert message["reasoning_content"]  # the grammar applies after the reasoning
            assert re.fullmatch(regex, content), content
        text = client.post("/v1/completions", json={"prompt": "List:", "ebnf": ebnf}).json()
        assert re.fullmatch(f"{item}(,{item})*", text["choices"][0]["text"])
        bad = client.post("/v1/completions", json={"prompt": "x", "regex": "(unclosed"})
        assert bad.status_code == 400
        assert bad.json()["object"] == "error"


def test_grammar_errors_match_sglang(emu: ManagedProcess, sg: Any) -> None:
    protocol, _ = sg
    no_schema = {"type": "json_schema", "json_schema": {"name": "x"}}
    with httpx.Client(base_url=emu.url, timeout=30) as client:
        response = client.post(
            "/v1/completions", json={"prompt": "x", "response_format": no_schema}
        )
    assert response.status_code == 400
    error = protocol.ErrorResponse.model_validate(response.json())
    assert error.message == "schema_ is required for json_schema response format request."


def test_queue_full_for_one_choice_answers_at_once(procs: ProcessManager) -> None:
    emu = procs.start(
        [*EMULATE, "--max-running-requests", "1", "--max-queued-requests", "0"], name="emu"
    )
    with httpx.Client(base_url=emu.url, timeout=30) as client:
        full = client.post("/v1/chat/completions", json={**CHAT, "n": 2, "max_tokens": 5})
        assert full.status_code == 503
        assert full.json()["message"] == "The request queue is full."
        totals = stats(client)["totals"]
        assert totals["queue_rejected"] == 1
        # the admitted choice ended with the request and gave its slot back
        records = wait_for(lambda: stats(client)["requests"], what="the admitted choice")
        assert [r["aborted"] for r in records] == ["abort"]
        again = client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 5})
        assert again.status_code == 200


def test_logprobs_cover_tool_call_steps_and_zero_top(emu: ManagedProcess, sg: Any) -> None:
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            },
        }
    ]
    body = {
        **CHAT,
        "tools": tools,
        "tool_choice": "required",
        "logprobs": True,
        "chat_template_kwargs": {"thinking": False},
        "stream_options": {"include_usage": True},
    }
    with httpx.Client(base_url=emu.url, timeout=30) as client:
        chunks = check_chat_stream(sg, _raw_events(client, "/v1/chat/completions", body))
        plain = client.post("/v1/completions", json={"prompt": "Hi", "logprobs": 0}).json()
    tokens = [
        t["token"]
        for c in chunks
        if c["choices"] and c["choices"][0]["logprobs"]
        for t in c["choices"][0]["logprobs"]["content"]
    ]
    assert len(tokens) == chunks[-1]["usage"]["completion_tokens"]
    assert tokens[:2] == ["<|tool_calls_section_begin|>", "<|tool_call_begin|>"]
    assert tokens[2] == "functions.get_weather:0" and tokens[-1] == "<|im_end|>"
    # tool-call chunks never carry logprobs; their step's come in a chunk of their own
    calls = [c for c in chunks if c["choices"] and c["choices"][0]["delta"].get("tool_calls")]
    assert calls and all(c["choices"][0]["logprobs"] is None for c in calls)
    lp = plain["choices"][0]["logprobs"]
    assert lp["top_logprobs"] == [] and len(lp["tokens"]) == plain["usage"]["completion_tokens"]
