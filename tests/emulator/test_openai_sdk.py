"""The openai SDK (sync and async) against a real emulator process."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest

from tests.support.procs import PYTHON, ManagedProcess, ProcessManager

MODEL = "moonshotai/Kimi-K2.5"
MESSAGES: list[Any] = [{"role": "user", "content": "What is the capital of France?"}]
TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "lookup_capital",
            "parameters": {
                "type": "object",
                "properties": {"country": {"type": "string"}},
                "required": ["country"],
            },
        },
    }
]


@pytest.fixture
def client(emu: ManagedProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=emu.url + "/v1", api_key="none") as sync_client:
        yield sync_client


@pytest.fixture
def emu(procs: ProcessManager) -> ManagedProcess:
    """A fresh emulator process per test, from the shared ``procs`` fixture."""
    return procs.start(
        [PYTHON, "-m", "app", "emulate", "--port", "{port}", "--speed", "50"], name="emu"
    )


def test_sync_non_stream(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=300)
    message = out.choices[0].message
    assert out.id and out.model == MODEL
    assert isinstance(message.content, str)
    assert getattr(message, "reasoning_content", None)  # SGLang's extra field
    assert out.usage is not None and out.usage.completion_tokens > 0
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_sync_stream_reasoning_then_content(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        stream=True,
        max_tokens=2000,
        stream_options={"include_usage": True},
    )
    reasoning, content, finish, usage = [], [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        extra = delta.model_extra or {}
        if extra.get("reasoning_content"):
            assert not content, "reasoning comes before content"
            reasoning.append(extra["reasoning_content"])
        if delta.content:
            content.append(delta.content)
        finish = chunk.choices[0].finish_reason or finish
    assert reasoning and content
    assert finish == "stop"
    assert usage is not None and usage.completion_tokens > len(content)


def test_sync_tool_call_stream_and_not(client: openai.OpenAI) -> None:
    messages: list[Any] = [{"role": "user", "content": "Use lookup_capital for France."}]
    out = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS)
    call = out.choices[0].message.tool_calls[0]  # type: ignore[index]
    assert out.choices[0].finish_reason == "tool_calls"
    assert call.id == "functions.lookup_capital:0"
    assert call.function.name == "lookup_capital"  # type: ignore[union-attr]
    assert "country" in call.function.arguments  # type: ignore[union-attr]
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, stream=True
    )
    name, args, finish = None, "", None
    for chunk in stream:
        delta = chunk.choices[0].delta
        for tc in delta.tool_calls or []:
            name = tc.function.name or name  # type: ignore[union-attr]
            args += tc.function.arguments or ""  # type: ignore[union-attr]
        finish = chunk.choices[0].finish_reason or finish
    assert name == "lookup_capital" and finish == "tool_calls"
    assert args == call.function.arguments  # type: ignore[union-attr]


async def test_async_stream_and_not(emu: ManagedProcess) -> None:
    async with openai.AsyncOpenAI(base_url=emu.url + "/v1", api_key="none") as client:
        out = await client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            max_tokens=40,
            extra_body={"rid": "sdk-async-1", "chat_template_kwargs": {"thinking": False}},
        )
        assert out.id == "sdk-async-1"
        assert out.choices[0].finish_reason == "length"
        assert out.choices[0].message.content
        stream = await client.completions.create(
            model=MODEL, prompt="Once upon a time", max_tokens=25, stream=True
        )
        text = [c.choices[0].text async for c in stream if c.choices]
        assert "".join(text)
