"""The anthropic SDK (sync, async, streams) against a real gateway in front of real emulators."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import pytest

from tests.e2e.conftest import Stack, emulator, gateway
from tests.support.procs import ManagedProcess, managed_processes

MODEL = "moonshotai/Kimi-K2.5"
KEY = "sk-anthropic-e2e-0123456789"
WEATHER: dict[str, Any] = {
    "name": "get_weather",
    "description": "The weather in a city.",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
    "cache_control": {"type": "ephemeral"},
}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    env = {"DFLASH_GATEWAY_API_KEYS": KEY, "DFLASH_GATEWAY_TIMEOUTS__KEEPALIVE_S": "0.2"}
    with managed_processes(tmp_path_factory, "anthropic") as manager:
        emus = [emulator(manager, "emu-a"), emulator(manager, "emu-b")]
        yield Stack(gateway(manager, emus, env=env), emus)


@pytest.fixture
def gw(stack: Stack) -> Iterator[ManagedProcess]:
    stack.reset()
    yield stack.gw
    stack.reset()


@pytest.fixture
def client(gw: ManagedProcess) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(base_url=gw.url, api_key=KEY, max_retries=0) as sync_client:
        yield sync_client


def test_sync_create_thinks_by_default(client: anthropic.Anthropic) -> None:
    out = client.messages.create(
        model=MODEL,
        max_tokens=4000,
        system=[{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        metadata={"user_id": "session-1"},
    )
    assert out.type == "message" and out.role == "assistant" and out.model == MODEL
    assert out.id.startswith("msg_")
    kinds = [block.type for block in out.content]
    assert kinds == ["thinking", "text"]  # Kimi-K2.5 thinks unless told not to
    assert out.stop_reason == "end_turn" and out.stop_sequence is None
    assert out.usage.input_tokens > 0 and out.usage.output_tokens > 0


def test_thinking_disabled_and_max_tokens(client: anthropic.Anthropic) -> None:
    out = client.messages.create(
        model=MODEL,
        max_tokens=20,
        thinking={"type": "disabled"},
        messages=[{"role": "user", "content": "Tell me a long story."}],
    )
    assert [block.type for block in out.content] == ["text"]
    assert out.stop_reason == "max_tokens"
    assert out.usage.output_tokens == 20


def test_stop_sequence(client: anthropic.Anthropic) -> None:
    out = client.messages.create(
        model=MODEL,
        max_tokens=2000,
        thinking={"type": "disabled"},
        stop_sequences=["e"],
        messages=[{"role": "user", "content": "Say something."}],
    )
    assert out.stop_reason == "stop_sequence" and out.stop_sequence == "e"


def test_stream_text_and_final_message(client: anthropic.Anthropic) -> None:
    with client.messages.stream(
        model=MODEL,
        max_tokens=4000,
        thinking={"type": "enabled", "budget_tokens": 2048},
        messages=[{"role": "user", "content": "What is the capital of France?"}],
    ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text
    assert [block.type for block in final.content] == ["thinking", "text"]
    assert final.content[1].text == text  # type: ignore[union-attr]
    assert final.content[0].thinking  # type: ignore[union-attr]
    assert final.stop_reason == "end_turn"
    assert final.usage.output_tokens > 0 and final.usage.input_tokens > 0


def test_tool_use_round_trip(client: anthropic.Anthropic) -> None:
    messages: list[Any] = [{"role": "user", "content": "Use get_weather for Paris."}]
    first = client.messages.create(model=MODEL, max_tokens=4000, tools=[WEATHER], messages=messages)
    assert first.stop_reason == "tool_use"
    call = next(block for block in first.content if block.type == "tool_use")
    assert call.name == "get_weather"
    assert call.id == "functions.get_weather:0"  # Kimi-K2.5's ids, kept
    assert isinstance(call.input, dict) and "city" in call.input
    messages += [
        {"role": "assistant", "content": first.content},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "Sunny."}],
        },
    ]
    with client.messages.stream(
        model=MODEL, max_tokens=4000, tools=[WEATHER], messages=messages
    ) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "end_turn"
    assert final.content[-1].type == "text" and final.content[-1].text


def test_tool_use_streamed_as_input_json(client: anthropic.Anthropic) -> None:
    with client.messages.stream(
        model=MODEL,
        max_tokens=4000,
        thinking={"type": "disabled"},
        tools=[WEATHER],
        tool_choice={"type": "tool", "name": "get_weather"},
        messages=[{"role": "user", "content": "What's it like in Oslo?"}],
    ) as stream:
        partial = [e.partial_json for e in stream if e.type == "input_json"]  # type: ignore[union-attr]
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use"
    assert [block.type for block in final.content] == ["tool_use"]
    call = final.content[0]
    assert call.type == "tool_use" and set(call.input) == {"city"}  # type: ignore[arg-type]
    assert len(partial) > 1 and json.loads("".join(partial)) == call.input


async def test_async_create_and_stream(gw: ManagedProcess) -> None:
    async with anthropic.AsyncAnthropic(base_url=gw.url, auth_token=KEY, max_retries=0) as aclient:
        out = await aclient.messages.create(
            model=MODEL,
            max_tokens=30,
            thinking={"type": "disabled"},
            messages=[{"role": "user", "content": "Hello"}],
        )
        assert out.content[0].type == "text" and out.stop_reason == "max_tokens"
        async with aclient.messages.stream(
            model=MODEL, max_tokens=50, messages=[{"role": "user", "content": "Hello"}]
        ) as stream:
            final = await stream.get_final_message()
        assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 50
        count = await aclient.messages.count_tokens(
            model=MODEL, messages=[{"role": "user", "content": "Hello there, how are you?"}]
        )
        assert count.input_tokens > 0


def test_count_tokens_matches_the_prompt(client: anthropic.Anthropic) -> None:
    messages: list[Any] = [{"role": "user", "content": "Count me " * 50}]
    count = client.messages.count_tokens(model=MODEL, messages=messages, system="Be brief.")
    out = client.messages.create(
        model=MODEL,
        max_tokens=5,
        system="Be brief.",
        messages=messages,
        thinking={"type": "disabled"},
    )
    assert count.input_tokens == out.usage.input_tokens > 50


def test_errors_in_anthropic_shape(client: anthropic.Anthropic, gw: ManagedProcess) -> None:
    with pytest.raises(anthropic.BadRequestError) as bad:
        client.messages.create(model=MODEL, max_tokens=10, messages=[])
    assert bad.value.status_code == 400
    assert bad.value.body["type"] == "error"  # type: ignore[index]
    assert bad.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    with pytest.raises(anthropic.NotFoundError) as missing:
        client.messages.create(
            model="no-such-model", max_tokens=10, messages=[{"role": "user", "content": "x"}]
        )
    assert missing.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
    wrong = anthropic.Anthropic(base_url=gw.url, api_key="sk-wrong-key-000000", max_retries=0)
    with wrong, pytest.raises(anthropic.AuthenticationError) as denied:
        wrong.messages.create(
            model=MODEL, max_tokens=5, messages=[{"role": "user", "content": "x"}]
        )
    assert denied.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
    # max_tokens is required, as on Anthropic's API; the raw answer is Anthropic-shaped.
    raw = httpx.post(
        gw.url + "/v1/messages",
        headers={"x-api-key": KEY, "anthropic-version": "2023-06-01"},
        json={"model": MODEL, "messages": [{"role": "user", "content": "x"}]},
    )
    assert raw.status_code == 400
    assert raw.json()["error"] == {
        "type": "invalid_request_error",
        "message": "max_tokens: a positive integer is required",
    }
    twice = httpx.post(
        gw.url + "/v1/messages",
        headers=[("x-api-key", KEY), ("x-api-key", KEY)],
        json={"model": MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]},
    )
    assert twice.status_code == 400 and twice.json()["type"] == "error"


def test_metrics_count_the_messages_route(client: anthropic.Anthropic, gw: ManagedProcess) -> None:
    client.messages.create(model=MODEL, max_tokens=5, messages=[{"role": "user", "content": "Hi"}])
    text = httpx.get(gw.url + "/metrics", headers={"authorization": f"Bearer {KEY}"}).text
    found = re.search(
        r'dflash_gateway_requests_total\{model="moonshotai/Kimi-K2.5",route="/v1/messages",'
        r'status="200"\} (\d+)',
        text,
    )
    assert found is not None and int(found.group(1)) >= 1


EVENT = re.compile(r"event: (\w+)\ndata: (.*)\n\n")


def test_coding_agent_shaped_stream_event_order(gw: ManagedProcess) -> None:
    """A long system prompt in blocks with cache_control, ~20 tools, streaming: the events
    follow Anthropic's grammar exactly."""
    tools = [
        {
            "name": f"tool_{i}",
            "description": "A tool. " * 40,
            "input_schema": {
                "type": "object",
                "properties": {"path": {"type": "string"}, "limit": {"type": "integer"}},
                "required": ["path"],
            },
            **({"cache_control": {"type": "ephemeral"}} if i == 19 else {}),
        }
        for i in range(20)
    ]
    body = {
        "model": MODEL,
        "max_tokens": 8000,
        "stream": True,
        "system": [
            {"type": "text", "text": "You are a coding agent."},
            {"type": "text", "text": "Rules. " * 2000, "cache_control": {"type": "ephemeral"}},
        ],
        "tools": tools,
        "metadata": {"user_id": "user_abc_session_123"},
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "<system-reminder>context</system-reminder>"},
                    {
                        "type": "text",
                        "text": "Please call tool_7 on README.md",
                        "cache_control": {"type": "ephemeral"},
                    },
                ],
            }
        ],
    }
    headers = {"x-api-key": KEY, "anthropic-version": "2023-06-01", "anthropic-beta": "x"}
    url = gw.url + "/v1/messages?beta=true"  # as Claude Code calls it
    with httpx.stream("POST", url, json=body, headers=headers) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = response.read().decode()
    names = [name for name, _ in EVENT.findall(raw)]
    assert EVENT.sub("", raw) == ""  # nothing but whole named events
    names = [n for n in names if n != "ping"]
    grammar = (
        r"message_start (content_block_start (content_block_delta )*content_block_stop )+"
        r"message_delta message_stop "
    )
    assert re.fullmatch(grammar, " ".join(names) + " "), names
    events = [json.loads(data) for _, data in EVENT.findall(raw)]
    starts = [e["content_block"] for e in events if e["type"] == "content_block_start"]
    assert [s["type"] for s in starts] == ["thinking", "tool_use"]
    assert starts[1]["name"] == "tool_7" and starts[1]["id"] == "functions.tool_7:0"
    deltas = {e["delta"]["type"] for e in events if e["type"] == "content_block_delta"}
    assert deltas == {"thinking_delta", "input_json_delta"}
    indexes = [e["index"] for e in events if "index" in e]
    assert indexes == sorted(indexes) and set(indexes) == {0, 1}
    end = next(e for e in events if e["type"] == "message_delta")
    assert end["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert end["usage"]["output_tokens"] > 0 and end["usage"]["input_tokens"] > 3000


HEADERS = {"x-api-key": KEY, "anthropic-version": "2023-06-01"}
STREAMED = {
    "model": MODEL,
    "max_tokens": 3000,
    "stream": True,
    "messages": [{"role": "user", "content": "Write about the sea."}],
}


def test_failure_after_the_commit_point_is_an_error_event(stack: Stack, gw: ManagedProcess) -> None:
    for emu in stack.emus:
        stack.control(emu, "/emulator/faults", {"die_after_chunks": 6})
    with httpx.stream("POST", gw.url + "/v1/messages", json=STREAMED, headers=HEADERS) as response:
        raw = response.read().decode()
    names = [name for name, _ in EVENT.findall(raw) if name != "ping"]
    assert names[0] == "message_start" and names[-1] == "error"
    assert "message_stop" not in names
    error = json.loads(EVENT.findall(raw)[-1][1])
    assert error == {
        "type": "error",
        "error": {"type": "api_error", "message": "the worker's stream was interrupted"},
    }


def test_failed_worker_is_retried_before_the_commit_point(
    stack: Stack, client: anthropic.Anthropic
) -> None:
    stack.control(stack.emus[0], "/emulator/faults", {"fail_status": 503, "fail_ratio": 1.0})
    for _ in range(4):
        with client.messages.stream(
            model=MODEL, max_tokens=20, messages=[{"role": "user", "content": "Hi"}]
        ) as stream:
            assert stream.get_final_message().stop_reason == "max_tokens"


def test_ping_while_the_worker_is_silent(stack: Stack, gw: ManagedProcess) -> None:
    for emu in stack.emus:
        stack.control(emu, "/emulator/gate", {"hold_after_chunks": 3})
    seen: list[str] = []
    with httpx.stream("POST", gw.url + "/v1/messages", json=STREAMED, headers=HEADERS) as response:
        lines = response.iter_lines()
        for line in lines:
            if line.startswith("event: "):
                seen.append(line[7:])
            if seen[-1:] == ["ping"] and "message_start" in seen:
                break
        for emu in stack.emus:
            stack.control(emu, "/emulator/gate", {"release": True})
        rest = [line[7:] for line in lines if line.startswith("event: ")]
    assert next(name for name in seen if name != "ping") == "message_start"
    assert rest[-2:] == ["message_delta", "message_stop"]
