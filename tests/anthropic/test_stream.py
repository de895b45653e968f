"""The stream translator on SGLang-shaped chat chunks (the emulator's renderer)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from app.anthropic.stream import MessagesStream
from app.emulator import render
from app.emulator.generation import ToolDelta
from app.errors import UpstreamStatusError

USAGE = render.usage(120, 9, 4, None)


def worker_stream(*, tool: bool = False, finish: str = "stop", matched: Any = 163586) -> bytes:
    chunks = render.ChatChunks("abc123", 1, "moonshotai/Kimi-K2.5", tools_active=tool)
    parts = [chunks.role(), chunks.reasoning("Let me "), chunks.reasoning("think.")]
    if tool:
        parts += [
            chunks.tool(ToolDelta(0, "functions.read:0", "read", "")),
            chunks.tool(ToolDelta(0, None, None, '{"path": ')),
            chunks.tool(ToolDelta(0, None, None, '"a.md"}')),
        ]
    else:
        parts += [chunks.content("Hello"), chunks.content(" world")]
    parts += [chunks.finish(finish, matched), chunks.usage(USAGE), render.DONE]
    return b"".join(parts)


def events(raw: bytes) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for block in raw.decode().split("\n\n")[:-1]:
        name, data = block.split("\n")
        assert name.startswith("event: ") and data.startswith("data: ")
        out.append((name[7:], json.loads(data[6:])))
    return out


def test_text_stream_in_anthropic_grammar() -> None:
    translator = MessagesStream("kimi")
    got = events(translator.feed(worker_stream()))
    assert [name for name, _ in got] == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert got[0][1]["message"]["id"] == "msg_abc123"
    assert got[0][1]["message"]["model"] == "kimi"
    assert got[1][1]["content_block"] == {"type": "thinking", "thinking": "", "signature": ""}
    assert got[2][1]["delta"] == {"type": "thinking_delta", "thinking": "Let me "}
    assert got[5][1] == {
        "type": "content_block_start",
        "index": 1,
        "content_block": {"type": "text", "text": ""},
    }
    assert got[7][1]["delta"] == {"type": "text_delta", "text": " world"}
    assert got[9][1] == {
        "type": "message_delta",
        "delta": {"stop_reason": "end_turn", "stop_sequence": None},
        "usage": {"input_tokens": 120, "output_tokens": 9},
    }
    assert translator.first_data and translator.done and not translator.inband_error
    assert translator.usage is not None and translator.usage.completion_tokens == 9
    assert translator.usage.verify_steps == 4  # 6 chunks with choices, less role and finish


def test_tool_call_stream_and_stop_reason() -> None:
    got = events(MessagesStream("kimi").feed(worker_stream(tool=True, finish="tool_calls")))
    starts = [data["content_block"] for name, data in got if name == "content_block_start"]
    assert starts[1] == {"type": "tool_use", "id": "functions.read:0", "name": "read", "input": {}}
    partial = [
        data["delta"]["partial_json"]
        for name, data in got
        if name == "content_block_delta" and data["index"] == 1
    ]
    assert json.loads("".join(partial)) == {"path": "a.md"}
    assert got[-2][1]["delta"]["stop_reason"] == "tool_use"


def test_matched_stop_sequence() -> None:
    got = events(MessagesStream("kimi").feed(worker_stream(matched="END")))
    assert got[-2][1]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "END"}


@pytest.mark.parametrize("size", [1, 7, 64, 1000])
def test_reads_split_anywhere_give_the_same_events(size: int) -> None:
    raw = worker_stream(tool=True, finish="tool_calls")
    whole = MessagesStream("kimi").feed(raw)
    translator = MessagesStream("kimi")
    pieces = [translator.feed(raw[i : i + size]) for i in range(0, len(raw), size)]
    assert b"".join(pieces) + translator.finish() == whole
    assert translator.done


def test_crlf_framing_and_an_unterminated_done() -> None:
    raw = worker_stream().replace(b"\n\n", b"\r\n\r\n")[: -len(b"\r\n\r\n")]
    translator = MessagesStream("kimi")
    out = translator.feed(raw) + translator.finish()
    assert out == MessagesStream("kimi").feed(worker_stream())
    assert translator.done


def test_error_before_the_first_chunk_is_raised_for_a_retry() -> None:
    error = render.error_event("The request queue is full.", "SERVICE_UNAVAILABLE", 503)
    with pytest.raises(UpstreamStatusError) as raised:
        MessagesStream("kimi").feed(error + render.DONE)
    assert raised.value.status == 503


def test_error_after_the_commit_point_is_an_error_event() -> None:
    chunks = render.ChatChunks("x", 1, "m", tools_active=False)
    error = render.error_event("The request was aborted by the worker.", "X", 503)
    translator = MessagesStream("kimi")
    got = events(translator.feed(chunks.role() + chunks.content("Hi") + error + render.DONE))
    assert [name for name, _ in got] == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "error",
    ]
    assert got[-1][1] == {
        "type": "error",
        "error": {"type": "overloaded_error", "message": "The request was aborted by the worker."},
    }
    assert translator.inband_error and translator.done


def test_accept_length_exposed_when_enabled() -> None:
    got = events(MessagesStream("kimi", expose=True).feed(worker_stream()))
    assert got[-2][1]["usage"]["spec_accept_length"] == 2.25  # 9 tokens / 4 steps


def test_omitted_thinking_keeps_the_block_without_its_text() -> None:
    """``thinking.display: "omitted"`` (Claude Code's default): the thinking block is there,
    empty; the answer's text is whole."""
    got = events(MessagesStream("kimi", omit_thinking=True).feed(worker_stream()))
    starts = [data["content_block"]["type"] for name, data in got if name == "content_block_start"]
    deltas = [data["delta"] for name, data in got if name == "content_block_delta"]
    assert starts == ["thinking", "text"]
    assert deltas == [
        {"type": "text_delta", "text": "Hello"},
        {"type": "text_delta", "text": " world"},
    ]
