"""Type-confused and escape-encoded bodies on every surface, against one real gateway process in
front of a recording stand-in worker (tests/security/recorder.py).

Each surface has a rich, valid body that sets every field the gateway reads, translates or
polices. Every value in it, at every depth, is replaced in turn by a list, an object, a number,
a boolean, null and a huge string; every third case has each JSON key written as ``\\uXXXX``
escapes, and cases alternate between streamed and not. Then each policed thing (media URLs of
every kind, ``chat_template_kwargs`` keys, denied fields) is planted, poisoned, in plain,
key-escaped, value-escaped and partly escaped spellings. Whatever the gateway answers, it is
never a 5xx, its log holds no traceback, every stream it answers ends as its API ends one, and
the worker never receives a poisoned value, a denied field or a template keyword off the
allow-list (read from what the worker decodes, not from the bytes).
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import orjson
import pytest

from app.media_policy import DEFAULT_POLICY
from app.proxy.fields import DENIED
from app.proxy.media import MEDIA_PARTS, check_image_url
from tests.security.recorder import MODEL, RecordingWorker, recording_worker
from tests.security.stack import start_gateway
from tests.support.procs import ManagedProcess, managed_processes

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MESSAGES = "/v1/messages"
COUNT = "/v1/messages/count_tokens"
RESPONSES = "/v1/responses"
POISON = "FUZZPOISON"
TEMPLATE_KWARGS = {"thinking", "enable_thinking"}  # the default allow-list
HUGE = "h" * 64 * 1024
BAD_VALUES: list[Any] = [["x", {}], {"a": [1]}, -1.5, True, None, HUGE]

IMAGE = "https://example.com/cat.png"
CHAT_BODY: dict[str, Any] = {
    "model": MODEL,
    "messages": [
        {"role": "system", "content": "Be brief.\n"},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "What is this?"},
                {"type": "image_url", "image_url": {"url": IMAGE, "detail": "low"}},
                {"type": "video_url", "video_url": {"url": IMAGE}},
                {"type": "audio_url", "audio_url": {"url": IMAGE}},
            ],
        },
        {"role": "assistant", "content": "A cat."},
        {"role": "user", "content": "Sure?"},
    ],
    "max_tokens": 8,
    "max_completion_tokens": 8,
    "n": 1,
    "user": "u1",
    "stream_options": {"include_usage": True, "continuous_usage_stats": False},
    "chat_template_kwargs": {"thinking": False, "enable_thinking": False},
    "return_meta_info": False,
    "temperature": 0.5,
    "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
    "tool_choice": "auto",
    "response_format": {"type": "text"},
    "stop": ["\n\n"],
    "top_k": 5,
}
COMPLETIONS_BODY: dict[str, Any] = {
    "model": MODEL,
    "prompt": ["Once upon", "a time"],
    "max_tokens": 8,
    "n": 1,
    "best_of": 1,
    "user": "u1",
    "echo": False,
    "suffix": "end",
    "stream_options": {"include_usage": True},
}
MESSAGES_BODY: dict[str, Any] = {
    "model": MODEL,
    "max_tokens": 8,
    "system": [{"type": "text", "text": "Be brief."}],
    "messages": [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Look"},
                {"type": "image", "source": {"type": "url", "url": IMAGE}},
                {
                    "type": "image",
                    "source": {"type": "base64", "media_type": "image/png", "data": "AA=="},
                },
                {"type": "document", "source": {"type": "text", "data": "doc"}},
            ],
        },
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "hmm"},
                {"type": "text", "text": "ok"},
                {"type": "tool_use", "id": "t1", "name": "f", "input": {"a": 1}},
            ],
        },
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": "t1",
                    "content": [
                        {"type": "text", "text": "r"},
                        {"type": "image", "source": {"type": "url", "url": IMAGE}},
                    ],
                },
                {"type": "text", "text": "and?"},
            ],
        },
        {"role": "system", "content": [{"type": "text", "text": "env"}]},
    ],
    "tools": [{"name": "f", "description": "d", "input_schema": {"type": "object"}}],
    "tool_choice": {"type": "tool", "name": "f", "disable_parallel_tool_use": True},
    "thinking": {"type": "enabled", "display": "omitted", "budget_tokens": 1024},
    "stop_sequences": ["STOP"],
    "temperature": 0.5,
    "top_p": 0.9,
    "top_k": 5,
    "metadata": {"user_id": "u1"},
    "context_management": {
        "edits": [
            {"type": "clear_thinking_20251015", "keep": {"type": "thinking_turns", "value": 1}}
        ]
    },
    "output_config": {"effort": "low", "format": {"type": "json_schema", "schema": {}}},
}
RESPONSES_BODY: dict[str, Any] = {
    "model": MODEL,
    "instructions": "Be brief.",
    "input": [
        {
            "type": "message",
            "role": "user",
            "content": [
                {"type": "input_text", "text": "Look"},
                {"type": "input_image", "image_url": IMAGE, "detail": "low"},
            ],
        },
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "s"}]},
        {
            "type": "function_call",
            "call_id": "c1",
            "name": "g",
            "namespace": "n",
            "arguments": "{}",
        },
        {
            "type": "function_call_output",
            "call_id": "c1",
            "output": [{"type": "input_text", "text": "42"}],
        },
        {"role": "developer", "content": "Mind the output."},
    ],
    "tools": [
        {"type": "function", "name": "f", "parameters": {}, "strict": True, "description": "d"},
        {"type": "namespace", "name": "n", "tools": [{"type": "function", "name": "g"}]},
    ],
    "tool_choice": {"type": "function", "name": "f"},
    "parallel_tool_calls": True,
    "max_output_tokens": 8,
    "temperature": 0.5,
    "top_p": 0.9,
    "text": {"format": {"type": "json_schema", "name": "o", "schema": {}, "strict": True}},
    "reasoning": {"effort": "low", "summary": "auto"},
    "user": "u1",
    "store": True,
    "metadata": {"k": "v"},
    "include": ["reasoning.encrypted_content"],
    "truncation": "disabled",
    "prompt_cache_key": "pk",
}
# Fields whose every value changes what is done with the rest (a stream; a stored conversation,
# refused features): set to each bad value on their own, beside the valid body.
ADDED = {
    CHAT: ("stream",),
    COMPLETIONS: ("stream",),
    MESSAGES: ("stream", "output_format"),
    COUNT: ("stream",),
    RESPONSES: (
        "stream",
        "previous_response_id",
        "background",
        "conversation",
        "prompt",
        "max_tool_calls",
        "top_logprobs",
    ),
}
SURFACES: list[tuple[str, dict[str, Any]]] = [
    (CHAT, CHAT_BODY),
    (COMPLETIONS, COMPLETIONS_BODY),
    (MESSAGES, MESSAGES_BODY),
    (COUNT, {k: v for k, v in MESSAGES_BODY.items() if k != "max_tokens"}),
    (RESPONSES, RESPONSES_BODY),
]

# Poisoned media URLs: each a form the policy refuses.
BAD_URLS = [
    f"file:///etc/{POISON}",
    f"https://169.254.169.254/{POISON}",
    f"https://kubernetes.default/{POISON}",
    f"https://[2002:a9fe:a9fe::]/{POISON}",
    f"http://example.com/{POISON}",
    f"/var/lib/{POISON}.png",
]


def _paths(value: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    if path:
        yield path
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _paths(item, (*path, key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from _paths(item, (*path, index))


def _replace(body: dict[str, Any], path: tuple[Any, ...], value: Any) -> dict[str, Any]:
    body = copy.deepcopy(body)
    node: Any = body
    for step in path[:-1]:
        node = node[step]
    node[path[-1]] = value
    return body


def _escaped(text: str) -> bytes:
    return b'"' + "".join(f"\\u{ord(c):04x}" for c in text).encode() + b'"'


def encode(value: Any, *, keys: bool = False, values: bool = False, only: str = "") -> bytes:
    """``value`` as JSON text; ``keys``/``values``: every key / string value (short ones) written
    as ``\\uXXXX`` escapes; ``only``: just these characters escaped, in keys and values."""
    if not (keys or values or only):
        return orjson.dumps(value)
    if isinstance(value, dict):
        items = [
            encode_string(k, keys, only) + b":" + encode(v, keys=keys, values=values, only=only)
            for k, v in value.items()
        ]
        return b"{" + b",".join(items) + b"}"
    if isinstance(value, list):
        return (
            b"[" + b",".join(encode(v, keys=keys, values=values, only=only) for v in value) + b"]"
        )
    if isinstance(value, str):
        return encode_string(value, values and len(value) < 1024, only)
    return orjson.dumps(value)


def encode_string(text: str, escape: bool, only: str) -> bytes:
    if escape:
        return _escaped(text)
    if only:
        plain = orjson.dumps(text).decode()
        return "".join(f"\\u{ord(c):04x}" if c in only else c for c in plain).encode()
    return orjson.dumps(text)


@dataclass(frozen=True)
class Case:
    name: str
    path: str
    body: bytes
    stream: bool
    poisoned: bool = False
    refused: bool = False  # must be a 400 (else the poisoned field may be dropped instead)


def _with_stream(body: dict[str, Any], path: str, stream: bool) -> dict[str, Any]:
    return body if path == COUNT and not stream else body | {"stream": stream}


def type_confused() -> list[Case]:
    cases = []
    for path, base in SURFACES:
        for i, (where, bad) in enumerate(
            (where, bad) for where in _paths(base) for bad in BAD_VALUES
        ):
            stream = i % 2 == 1
            body = _with_stream(_replace(base, where, bad), path, stream)
            name = f"{path} {'.'.join(map(str, where))}={str(bad)[:12]}"
            cases.append(Case(name, path, encode(body, keys=i % 3 == 0), stream))
        for i, (field, bad) in enumerate((f, bad) for f in ADDED[path] for bad in BAD_VALUES):
            name = f"{path} {field}={str(bad)[:12]}"
            cases.append(Case(name, path, encode(base | {field: bad}, keys=i % 3 == 0), False))
    return cases


def _planted(path: str, url: str) -> list[dict[str, Any]]:
    """Bodies for ``path`` each holding ``url`` where a worker would fetch it."""
    if path == CHAT:
        parts = [
            {"type": "image_url", "image_url": {"url": url}},
            {"type": "image_url", "image_url": url},
            {"type": "video_url", "video_url": {"url": url}},
            {"type": "audio_url", "audio_url": {"url": url}},
            {"image_url": {"url": url}},
        ]
        return [_replace(CHAT_BODY, ("messages", 1, "content", 1), part) for part in parts] + [
            _replace(CHAT_BODY, ("messages", 2, "content"), [parts[0]])
        ]
    if path in (MESSAGES, COUNT):
        base = SURFACES[2 if path == MESSAGES else 3][1]
        return [
            _replace(base, ("messages", 0, "content", 1, "source", "url"), url),
            _replace(base, ("messages", 2, "content", 0, "content", 1, "source", "url"), url),
        ]
    if path == RESPONSES:
        return [
            _replace(RESPONSES_BODY, ("input", 0, "content", 1, "image_url"), url),
            _replace(
                RESPONSES_BODY, ("input", 3, "output"), [{"type": "input_image", "image_url": url}]
            ),
        ]
    return []


def poisoned() -> list[Case]:
    """Each policed thing planted, poisoned; with whether the gateway must refuse it (else it
    may drop it: a field the surface does not take)."""
    bodies: list[tuple[str, dict[str, Any], bool]] = []
    for path, _ in SURFACES:
        for url in BAD_URLS:
            bodies += [(path, body, True) for body in _planted(path, url)]
    template = {"thinking": True, "chat_template": "{{ '" + POISON + "' }}"}
    for path, base in SURFACES:
        openai = path in (CHAT, COMPLETIONS)
        bodies += [(path, base | {field: POISON}, openai) for field in sorted(DENIED)]
        bodies.append((path, base | {"chat_template_kwargs": template}, path == CHAT))
    bodies.append((CHAT, CHAT_BODY | {"chat_template_kwargs": {"tokenize": POISON}}, True))
    spellings = [
        ("plain", {}),
        ("escaped keys", {"keys": True}),
        ("escaped values", {"values": True}),
        ("escaped keys and values", {"keys": True, "values": True}),
        ("escaped _", {"only": "_"}),
        ("escaped /:", {"only": "/:"}),
    ]
    cases = []
    for i, (path, body, refused) in enumerate(bodies):
        for j, (spelling, how) in enumerate(spellings):
            stream = (i + j) % 2 == 1
            raw = encode(_with_stream(body, path, stream), **how)
            name = f"{path} poisoned #{i} {spelling}"
            cases.append(Case(name, path, raw, stream, poisoned=True, refused=refused))
    return cases


@dataclass
class Stack:
    gw: ManagedProcess
    worker: RecordingWorker


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with recording_worker() as worker, managed_processes(tmp_path_factory, "fuzz2") as procs:
        gw = start_gateway(
            procs,
            [],
            args=("--worker-url", worker.url),
            env={"DFLASH_GATEWAY_RESPONSES__STORE": "memory"},
        )
        yield Stack(gw, worker)


class Answer:
    """One HTTP/1.1 answer: its status and body (de-chunked)."""

    def __init__(self, status: int, body: bytes) -> None:
        self.status_code = status
        self.content = body

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", "replace")


async def _read_answer(reader: asyncio.StreamReader) -> tuple[Answer, bool]:
    """An answer off a kept-alive connection, and whether the connection stays open."""
    head = await reader.readuntil(b"\r\n\r\n")
    line, *lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in lines if h)}
    if headers.get("transfer-encoding", "").lower() == "chunked":
        parts = []
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
            parts.append(await reader.readexactly(size + 2))
            if size == 0:
                break
        body = b"".join(part[:-2] for part in parts)
    else:
        body = await reader.readexactly(int(headers.get("content-length", "0")))
    keep = headers.get("connection", "").lower() != "close"
    return Answer(int(line.split()[1]), body), keep


async def _send_all(url: str, cases: list[Case], connections: int = 8) -> list[tuple[Case, Answer]]:
    """Every case POSTed, over ``connections`` kept-alive connections (a plain HTTP/1.1 client:
    the test's own cost stays small beside the gateway's)."""
    host, port = url.removeprefix("http://").split(":")
    queue = list(reversed(cases))
    answers: list[tuple[Case, Answer]] = []

    async def worker() -> None:
        reader = writer = None
        while queue:
            case = queue.pop()
            if writer is None:
                reader, writer = await asyncio.open_connection(host, int(port))
            assert reader is not None
            writer.write(
                b"POST %s HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\n"
                b"x-api-key: fuzz\r\nanthropic-version: 2023-06-01\r\n"
                b"content-length: %d\r\n\r\n%s" % (case.path.encode(), len(case.body), case.body)
            )
            answer, keep = await _read_answer(reader)
            answers.append((case, answer))
            if not keep:
                writer.close()
                reader = writer = None
        if writer is not None:
            writer.close()

    await asyncio.gather(*(worker() for _ in range(connections)))
    assert len(answers) == len(cases)
    return answers


def _stream_ended(path: str, text: str) -> bool:
    if path in (CHAT, COMPLETIONS):
        return text.endswith("data: [DONE]\n\n")
    if path == MESSAGES:
        return "event: message_stop" in text or "event: error" in text
    if path == RESPONSES:
        return any(
            f"event: {kind}" in text
            for kind in ("response.completed", "response.incomplete", "response.failed")
        )
    return True


def _check_answers(answers: list[tuple[Case, Answer]]) -> None:
    failures = []
    for case, response in answers:
        status = response.status_code
        if status >= 500:
            failures.append(f"{case.name}: {status} {response.text[:200]}")
        elif case.refused and status != 400:
            # A denied field, a refused URL or template keyword: refused, by name.
            failures.append(f"{case.name}: {status}, not refused")
        elif (status == 200 and case.stream and case.path != COUNT) and not _stream_ended(
            case.path, response.text
        ):
            failures.append(f"{case.name}: the stream did not end: {response.text[-200:]}")
    assert not failures, "\n".join(failures[:40])


def _check_worker(worker: RecordingWorker) -> None:
    """What the worker received, decoded as it decodes it."""
    assert worker.bodies
    checked = 0
    for raw in worker.bodies:
        body = orjson.loads(raw)
        decoded = orjson.dumps(body).decode()
        assert POISON not in decoded, decoded[:500]
        assert not DENIED.intersection(body) - {"rid"}, sorted(body)
        kwargs = body.get("chat_template_kwargs") or {}
        assert set(kwargs) <= TEMPLATE_KWARGS, kwargs
        for url in _media_urls(body):  # every URL a worker would fetch is one the policy allows
            check_image_url(url, DEFAULT_POLICY, "url")
            checked += 1
    assert checked > len(worker.bodies)  # the valid bodies' URLs were found and checked


def _media_urls(body: dict[str, Any]) -> Iterator[Any]:
    """The URLs of a body's media parts as the worker reads them: a chat body's parts, and a
    token count's Anthropic image sources (in tool results too)."""
    parts = []
    for message in body.get("messages") or ():
        content = message.get("content") if isinstance(message, dict) else None
        parts += content if isinstance(content, list) else ()
    for part in parts:
        if not isinstance(part, dict):
            continue
        for name in MEDIA_PARTS:
            value = part.get(name)
            if value is not None:
                yield value.get("url") if isinstance(value, dict) else value
        source = part.get("source")
        if isinstance(source, dict) and source.get("type") == "url":
            yield source.get("url")
        if isinstance(part.get("content"), list):
            parts += part["content"]  # a tool result's blocks


def test_type_confused_values_on_every_surface(stack: Stack) -> None:
    cases = type_confused()
    assert len(cases) > 1000  # every field of every surface, each way
    answers = asyncio.run(_send_all(stack.gw.url, cases))
    _check_answers(answers)
    served = sum(1 for _, response in answers if response.status_code == 200)
    assert served > 100  # the valid variants were served, not everything refused
    _check_worker(stack.worker)
    assert "Traceback" not in stack.gw.logs()


def test_poisoned_fields_never_reach_the_worker_however_spelled(stack: Stack) -> None:
    cases = poisoned()
    answers = asyncio.run(_send_all(stack.gw.url, cases))
    _check_answers(answers)
    _check_worker(stack.worker)
    assert "Traceback" not in stack.gw.logs()
