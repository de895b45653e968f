"""Grammars and schemas that would expand without end: the emulated worker refuses them with
SGLang's 400 error body at once, and keeps answering everyone else (its ``/health`` too) while
they arrive. Generous request timeouts, no timing assertions: before the expansion was bounded,
these requests held the worker's event loop for seconds to minutes (or exhausted its memory)."""

from __future__ import annotations

import re
import threading
from typing import Any

import httpx
import pytest

from tests.emulator.support import CHAT
from tests.support.procs import ManagedProcess


def _nested_items(depth: int, count: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string", "minLength": count}
    for _ in range(depth):
        schema = {"type": "array", "minItems": count, "items": schema}
    return schema


def _tool(parameters: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": "f", "parameters": parameters}}


HOSTILE: dict[str, dict[str, Any]] = {
    "regex 200^3": {"regex": "((a{200}){200}){200}"},
    "regex 1000^3": {"regex": "((a{1000}){1000}){1000}"},
    "regex 4e9": {"regex": "a{4000000000}"},
    "regex empty repeats": {"regex": "((?:){100000}){100000}"},
    "ebnf 1000^3": {"ebnf": 'root ::= (("a"){1000}){1000}\n'},
    "ebnf fan-out": {
        "ebnf": "".join(
            f"r{i} ::= r{i + 1} r{i + 1} r{i + 1} r{i + 1}\n" for i in range(12)
        ).replace("r0 ::=", "root ::=")
        + 'r12 ::= "abc"\n'
    },
    "schema minItems": {
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "x", "schema": _nested_items(3, 1000)},
        }
    },
    "schema minLength": {
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "x", "schema": {"type": "string", "minLength": 10**9}},
        }
    },
    "tool arguments": {
        "tools": [_tool({"type": "object", "properties": {"a": _nested_items(3, 500)}})],
        "tool_choice": "required",
    },
}


@pytest.mark.parametrize("extra", HOSTILE.values(), ids=HOSTILE.keys())
def test_an_explosive_grammar_is_a_400(emu: ManagedProcess, extra: dict[str, Any]) -> None:
    with httpx.Client(base_url=emu.url, timeout=10) as client:
        for stream in (False, True):
            response = client.post("/v1/chat/completions", json={**CHAT, **extra, "stream": stream})
            assert response.status_code == 400, response.text
            body = response.json()
            assert body["object"] == "error" and body["code"] == 400
            assert re.search(r"expands past \d+|nests too deeply", body["message"]), body


def test_the_worker_answers_others_while_explosive_grammars_arrive(emu: ManagedProcess) -> None:
    statuses: list[int] = []

    def attack() -> None:
        body = {**CHAT, "regex": "((a{1000}){1000}){1000}"}
        with httpx.Client(base_url=emu.url, timeout=30) as client:
            statuses.extend(
                client.post("/v1/chat/completions", json=body).status_code for _ in range(3)
            )

    attackers = [threading.Thread(target=attack) for _ in range(2)]
    for thread in attackers:
        thread.start()
    try:
        with httpx.Client(base_url=emu.url, timeout=3) as client:
            for _ in range(5):
                assert client.get("/health").status_code == 200
            served = client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 8})
            assert served.status_code == 200
    finally:
        for thread in attackers:
            thread.join(60)
    assert statuses == [400] * 6


def test_a_large_grammar_within_the_bound_is_served(emu: ManagedProcess) -> None:
    body = {
        **CHAT,
        "regex": "[a-z]{3000}",
        "max_tokens": 5000,
        "chat_template_kwargs": {"thinking": False},
    }
    with httpx.Client(base_url=emu.url, timeout=30) as client:
        response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200
    assert re.fullmatch("[a-z]{3000}", response.json()["choices"][0]["message"]["content"])
