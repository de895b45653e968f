"""Every response and stream chunk checked against SGLang's own models (sglang 0.5.23 wheel).

Chunks SGLang builds with its msgspec fast path (role, reasoning, content, finish) must equal,
byte for byte, what ``sse_utils.build_sse_content`` produces for the same fields; chunks and
bodies SGLang builds from pydantic models must validate and re-serialise to the same bytes/dict.
"""

from __future__ import annotations

import threading
import types
from typing import Any

import httpx
import orjson
import pytest

from tests.emulator import sglang_protocol
from tests.emulator.support import CHAT, record, wait_for
from tests.support.procs import ManagedProcess

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "days": {"type": "integer"},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city", "unit"],
            },
        },
    }
]


@pytest.fixture(scope="module")
def sg() -> tuple[types.ModuleType, types.ModuleType]:
    return sglang_protocol.load()


def _raw_events(client: httpx.Client, path: str, body: dict[str, Any]) -> list[str]:
    with client.stream("POST", path, json={**body, "stream": True}) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        return [line[6:] for line in response.iter_lines() if line.startswith("data: ")]


def check_chat_chunk(sg: tuple[types.ModuleType, types.ModuleType], raw: str) -> dict[str, Any]:
    protocol, sse_utils = sg
    obj: dict[str, Any] = orjson.loads(raw)
    model = protocol.ChatCompletionStreamResponse.model_validate(obj)
    choice = obj["choices"][0] if obj["choices"] else None
    if choice is None or choice["delta"].get("role", "x") is None:
        # pydantic path: tool calls, content while tool parsing is active, the usage chunk
        assert model.model_dump_json() == raw
    else:
        delta = choice["delta"]
        expected = sse_utils.build_sse_content(
            chunk_id=obj["id"],
            created=obj["created"],
            model=obj["model"],
            index=choice["index"],
            role=delta.get("role"),
            content=delta.get("content"),
            reasoning_content=delta.get("reasoning_content"),
            finish_reason=choice["finish_reason"],
            logprobs=choice["logprobs"],
            matched_stop=choice["matched_stop"],
            usage=obj.get("usage"),
        )
        assert expected == f"data: {raw}\n\n"
    return obj


def check_chat_stream(sg: Any, raws: list[str]) -> list[dict[str, Any]]:
    assert raws[-1] == "[DONE]"
    return [check_chat_chunk(sg, raw) for raw in raws[:-1]]


@pytest.mark.parametrize(
    "extra",
    [
        {"stream_options": {"include_usage": True}},
        {"stream_options": {"include_usage": True, "continuous_usage_stats": True}},
        {"chat_template_kwargs": {"thinking": False}},
        {"stop": [" the"]},
    ],
    ids=["usage", "continuous-usage", "no-thinking", "stop"],
)
def test_chat_stream_chunks_match_sglang(emu: ManagedProcess, sg: Any, extra: Any) -> None:
    with httpx.Client(base_url=emu.url, timeout=30) as client:
        chunks = check_chat_stream(
            sg, _raw_events(client, "/v1/chat/completions", {**CHAT, **extra})
        )
    finish = chunks[-2] if "stream_options" in extra else chunks[-1]
    assert finish["choices"][0]["finish_reason"] in ("stop", "length")
    if "stop" in extra:
        assert finish["choices"][0]["matched_stop"] == " the"


def test_chat_stream_tool_call_chunks(emu: ManagedProcess, sg: Any) -> None:
    body = {
        **CHAT,
        "tools": TOOLS,
        "tool_choice": "required",
        "stream_options": {"include_usage": True},
    }
    with httpx.Client(base_url=emu.url, timeout=30) as client:
        chunks = check_chat_stream(sg, _raw_events(client, "/v1/chat/completions", body))
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    calls = [d["tool_calls"][0] for d in deltas if d.get("tool_calls")]
    assert calls[0]["id"] == "functions.get_weather:0"
    assert calls[0]["function"] == {"name": "get_weather", "arguments": ""}
    assert all(c["id"] is None and c["function"]["name"] is None for c in calls[1:])
    args = orjson.loads("".join(c["function"]["arguments"] for c in calls))
    assert set(args) == {"city", "unit"} and args["unit"] == "celsius"
    assert chunks[-2]["choices"][0]["finish_reason"] == "tool_calls"
    assert chunks[-2]["choices"][0]["matched_stop"] is None


@pytest.mark.parametrize("tools", [False, True])
def test_chat_response_matches_sglang(emu: ManagedProcess, sg: Any, tools: bool) -> None:
    protocol, _ = sg
    body: dict[str, Any] = {**CHAT, "return_meta_info": True}
    if tools:
        choice = {"type": "function", "function": {"name": "get_weather"}}
        body = {**body, "tools": TOOLS, "tool_choice": choice}
    with httpx.Client(base_url=emu.url, timeout=30) as client:
        obj = client.post("/v1/chat/completions", json=body).json()
    model = protocol.ChatCompletionResponse.model_validate(obj)
    assert model.model_dump() == obj
    meta = obj["choices"][0]["meta_info"]
    spec_keys = {
        "spec_accept_length",
        "spec_verify_ct",
        "spec_accept_rate",
        "spec_num_correct_drafts",
        "spec_num_proposed_drafts",
        "spec_accept_histogram",
    }
    assert spec_keys <= set(meta)
    if tools:
        call = obj["choices"][0]["message"]["tool_calls"][0]
        assert call["id"] == "functions.get_weather:0" and call["index"] == 0
        assert obj["choices"][0]["finish_reason"] == "tool_calls"
        assert obj["choices"][0]["message"]["content"] == ""


def test_completion_stream_and_body_match_sglang(emu: ManagedProcess, sg: Any) -> None:
    protocol, _ = sg
    body = {"prompt": "Write a haiku", "max_tokens": 30, "stream_options": {"include_usage": True}}
    with httpx.Client(base_url=emu.url, timeout=30) as client:
        raws = _raw_events(client, "/v1/completions", body)
        plain = client.post("/v1/completions", json={"prompt": "Write a haiku"}).json()
    assert raws[-1] == "[DONE]"
    for raw in raws[:-2]:
        model = protocol.CompletionStreamResponse.model_validate_json(raw)
        assert model.model_dump_json() == raw
    usage = protocol.CompletionStreamResponse.model_validate_json(raws[-2])
    assert usage.model_dump_json(exclude_none=True) == raws[-2]
    assert protocol.CompletionResponse.model_validate(plain).model_dump() == plain


def test_models_and_errors_match_sglang(emu: ManagedProcess, sg: Any) -> None:
    protocol, _ = sg
    with httpx.Client(base_url=emu.url, timeout=30) as client:
        models = client.get("/v1/models").json()
        assert protocol.ModelList.model_validate(models).model_dump() == models
        assert models["data"][0]["id"] == "moonshotai/Kimi-K2.5"
        bad = [
            {**CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            {"messages": []},
            {**CHAT, "tool_choice": "required"},
        ]
        for body in bad:
            response = client.post("/v1/chat/completions", json=body)
            assert response.status_code == 400
            error = response.json()
            assert protocol.ErrorResponse.model_validate(error).model_dump() == error
            assert error["code"] == 400 and error["object"] == "error"
        fmt = {"type": "structural_tag", "structures": [], "triggers": []}
        response = client.post("/v1/completions", json={"prompt": "x", "response_format": fmt})
        assert response.status_code == 400  # not emulated (SGLang serves it)
        response = client.post("/v1/chat/completions", content=b"{not json")
        assert response.status_code == 400
        assert protocol.ErrorResponse.model_validate(response.json())


def test_abort_chunk_matches_sglang(emu: ManagedProcess, sg: Any) -> None:
    raws: list[str] = []

    def run() -> None:
        with httpx.Client(base_url=emu.url, timeout=30) as client:
            body = {**CHAT, "max_tokens": 100000, "rid": "fid-abort"}
            raws.extend(_raw_events(client, "/v1/chat/completions", body))

    with httpx.Client(base_url=emu.url, timeout=30) as client:
        client.post("/emulator/gate", json={"hold_after_chunks": 2})
        thread = threading.Thread(target=run)
        thread.start()
        wait_for(lambda: client.get("/emulator/gate").json()["held"] == 1, what="held")
        client.post("/abort_request", json={"rid": "fid-abort"})
        thread.join(30)
        assert record(client, "fid-abort")["aborted"] == "abort"
    chunks = check_chat_stream(sg, raws)
    assert chunks[-1]["choices"][0]["finish_reason"] == "abort"
