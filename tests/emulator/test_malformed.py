"""Malformed requests get SGLang's 400 error body from the emulated worker, never a 500: every
field of a chat and a text-completion body, in turn, set to values of the wrong type or shape
(and a few nested shapes: tool choices, tools, schemas, messages), streamed and not. A worker
that answered a client's bad input with a 500 would have the gateway count it against the
worker's health."""

from __future__ import annotations

import copy
from typing import Any

import httpx
import orjson

from tests.support.procs import ManagedProcess

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "f",
            "parameters": {"type": "object", "properties": {"a": {"type": "string"}}},
        },
    }
]
BASES: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {
        "messages": [{"role": "user", "content": "call f please"}],
        "max_tokens": 3,
        "tools": TOOLS,
        "chat_template_kwargs": {"thinking": False},
    },
    "/v1/completions": {"prompt": "hi", "max_tokens": 3},
}
FIELDS = (
    "messages",
    "prompt",
    "tools",
    "tool_choice",
    "response_format",
    "json_schema",
    "regex",
    "ebnf",
    "n",
    "max_tokens",
    "max_completion_tokens",
    "stop",
    "temperature",
    "seed",
    "rid",
    "priority",
    "stream_options",
    "chat_template_kwargs",
    "separate_reasoning",
    "return_meta_info",
    "logprobs",
    "top_logprobs",
    "ignore_eos",
    "model",
)
VALUES: tuple[Any, ...] = (
    None,
    True,
    -1,
    1.5,
    2**62,
    "x",
    "",
    [],
    [1],
    [None],
    [{}],
    {},
    {"a": 1},
    {"type": "function", "function": "f"},
    {"type": "function", "function": {"name": {}}},
    {"type": "json_schema", "json_schema": {"schema": {"allOf": [{"properties": 1}, 1]}}},
    {"type": "json_schema", "json_schema": {"schema": {"$ref": 5, "minItems": "x"}}},
    [{"function": {"name": "f", "parameters": {"properties": "x", "required": "a"}}}],
    [{"role": "assistant", "tool_calls": [1], "content": [1, {"text": 1}]}],
)


def _bodies() -> list[tuple[str, dict[str, Any]]]:
    out = []
    for path, base in BASES.items():
        for field in FIELDS:
            for i, value in enumerate(VALUES):
                body = copy.deepcopy(base)
                body[field] = value
                body["stream"] = i % 2 == 1
                out.append((path, body))
    return out


def test_no_malformed_body_gets_a_5xx(emu: ManagedProcess) -> None:
    failures = []
    with httpx.Client(base_url=emu.url, timeout=10) as client:
        for path, body in _bodies():
            response = client.post(path, json=body)
            if response.status_code >= 500:
                failures.append((path, body, response.status_code, response.text[:200]))
            elif response.status_code >= 400:
                error = response.json()
                assert error["object"] == "error" and error["code"] == response.status_code
            elif body["stream"]:
                assert response.text.endswith("data: [DONE]\n\n"), (body, response.text[-200:])
            else:
                assert orjson.loads(response.content)["choices"], body
    assert not failures, failures[:5]


def test_a_string_where_the_named_function_belongs_is_a_400(emu: ManagedProcess) -> None:
    body = {**BASES["/v1/chat/completions"], "tool_choice": {"type": "function", "function": "f"}}
    with httpx.Client(base_url=emu.url, timeout=10) as client:
        response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 400
    assert "tool_choice" in response.json()["message"]
