"""The Messages stream translator's bytes, pinned: recorded worker streams (text, thinking,
tool calls, usage, escapes, and hostile layouts that look like the common delta but are not)
against the events the translator wrote for them when every worker event was parsed whole
(``stream_golden.json``). Any change to how a chunk is read must keep the client's bytes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from app.anthropic.stream import MessagesStream
from app.emulator import render
from app.emulator.generation import ToolDelta
from app.errors import GatewayError

GOLDEN = Path(__file__).with_name("stream_golden.json")
HEAD = b'data: {"id":"abc123","object":"chat.completion.chunk","created":1,"model":"m","choices":'
TAIL = b',"logprobs":null,"finish_reason":null,"matched_stop":null}]}\n\n'


def _raw(delta: bytes, head: bytes = HEAD) -> bytes:
    return head + b'[{"index":0,"delta":' + delta + TAIL


def cases() -> dict[str, tuple[bytes, dict[str, Any]]]:
    chunks = render.ChatChunks("abc123", 1, "moonshotai/Kimi-K2.5", tools_active=True)
    usage = chunks.usage(render.usage(120, 9, 4, None))
    finish, done = chunks.finish("stop", 163586), render.DONE
    start = chunks.role()
    texts = ["Let me ", 'th"ink\\', "é ✓ 🙂", "", "line\nbreak", "\u2028", "</tag>"]
    mixed = [start]
    for i, text in enumerate(texts * 3):
        mixed.append(chunks.reasoning(text) if i % 5 < 2 else chunks.content(text))
    mixed += [finish, usage, done]
    tool = [
        start,
        chunks.reasoning("plan"),
        chunks.content("Reading."),
        chunks.tool(ToolDelta(0, "functions.read:0", "read", "")),
        chunks.tool(ToolDelta(0, None, None, '{"path": ')),
        chunks.tool(ToolDelta(0, None, None, '"a.md"}')),
        chunks.tool(ToolDelta(1, "functions.ls:1", "ls", "{}")),
        chunks.content("after"),
        chunks.finish("tool_calls", None),
        usage,
        done,
    ]
    escaped = [start, chunks.content("a")]
    escaped += [_raw(b'{"content":"\\u00e9\\/x"}'), _raw(b'{"content":"\\ud83d\\ude42"}')]
    escaped += [_raw(b'{"reasoning_content":null,"content":"b"}'), finish, usage, done]
    hostile = [start, chunks.content("a"), chunks.content("b")]
    hostile += [
        # A "reasoning" field beside an empty reasoning_content: the reasoning is read.
        _raw(b'{"reasoning":"r1","reasoning_content":"x"}'),
        _raw(b'{"reasoning":"r1","reasoning_content":"x2"}'),
        _raw(b'{"reasoning":"r1","reasoning_content":""}'),
        _raw(b'{"reasoning":"r1","reasoning_content":"x3"}'),
        _raw(b'{"reasoning":"r2","reasoning_content":""}'),
        _raw(b'{"reasoning":"r2","reasoning_content":"y"}'),
        # Two choices keys: the last one is the chunk's.
        HEAD + b'[{"index":0,"delta":{"content":"z"}}],"choices":[{"index":0,"delta":{"content":'
        b'"c"},"logprobs":null,"finish_reason":null,"matched_stop":null}]}\n\n',
        # Two choices: the first is read.
        HEAD + b'[{"index":0,"delta":{"content":"first"}},{"index":0,"delta":{"content":"d"},'
        b'"logprobs":null,"finish_reason":null,"matched_stop":null}]}\n\n',
        HEAD + b'[{"index":0,"delta":{"content":"first"}},{"index":0,"delta":{"content":"e"},'
        b'"logprobs":null,"finish_reason":null,"matched_stop":null}]}\n\n',
        # Another id and model mid-stream, a content of null, a nested content.
        _raw(b'{"content":"f"}', HEAD.replace(b"abc123", b"other")),
        _raw(b'{"content":null}'),
        _raw(b'{"x":{"content":"g"}}'),
        _raw(b'{"content":"h","tool_calls":[]}'),
        _raw(b'{"content":"i"}'),
        _raw(b'{"content":"j"}'),
        b'data: {"error":{"message":"boom","code":500}}\n\n',
        _raw(b'{"content":"k"}'),
        done,
    ]
    broken = [start, chunks.content("a"), chunks.content("b"), _raw(b'{"content":7}'), done]
    plain = render.ChatChunks("abc123", 1, "moonshotai/Kimi-K2.5", tools_active=False)
    layout = [plain.role()]  # SGLang's layout without tools
    for i, text in enumerate(texts * 3):
        layout.append(plain.reasoning(text) if i % 5 < 2 else plain.content(text))
    layout += [plain.finish("stop", None), plain.usage(render.usage(9, 21, 8, None)), done]
    return {
        "plain": (b"".join(layout), {}),
        "plain_omitted": (b"".join(layout), {"omit_thinking": True}),
        "mixed": (b"".join(mixed), {}),
        "mixed_omitted": (b"".join(mixed), {"omit_thinking": True}),
        "tool": (b"".join(tool), {"expose": True}),
        "escaped": (b"".join(escaped), {}),
        "hostile": (b"".join(hostile), {}),
        "broken": (b"".join(broken), {}),
    }


def translate(raw: bytes, options: dict[str, Any], size: int) -> str:
    stream = MessagesStream("kimi", **options)
    out: list[bytes] = []
    try:
        for at in range(0, len(raw), size):
            out.append(stream.feed(raw[at : at + size]))
        out.append(stream.finish())
    except GatewayError as exc:
        out.append(f"<raised {type(exc).__name__}: {exc}>".encode())
    usage = stream.usage
    counts = usage and (usage.prompt_tokens, usage.completion_tokens, usage.verify_steps)
    tally = (stream.events, stream.done, stream.inband_error, counts)
    return b"".join(out).decode() + f"\n<{tally!r}>"


SIZES = (1 << 20, 97, 7)  # the worker's bytes in one read, or cut into reads of this size


@pytest.mark.parametrize("name", sorted(cases()))
@pytest.mark.parametrize("size", SIZES)
def test_the_client_gets_the_recorded_bytes(name: str, size: int) -> None:
    raw, options = cases()[name]
    assert translate(raw, options, size) == json.loads(GOLDEN.read_text())[f"{name}/{size}"]


if __name__ == "__main__":  # records the golden file: only for a deliberate change of output
    golden = {f"{k}/{n}": translate(*v, n) for k, v in cases().items() for n in SIZES}
    GOLDEN.write_text(json.dumps(golden, indent=1))
