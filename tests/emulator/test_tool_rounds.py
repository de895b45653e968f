"""The emulator's tool-use round trip (Kimi-K2.5's kimi_k2 tool calls, then an answer that uses
the result) and its ``/v1/messages/count_tokens`` (SGLang's Anthropic token counter)."""

from __future__ import annotations

from typing import Any

import httpx

from tests.support.procs import ManagedProcess

MODEL = "moonshotai/Kimi-K2.5"
TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "lookup_capital",
            "parameters": {"type": "object", "properties": {"country": {"type": "string"}}},
        },
    }
]


def chat(emu: ManagedProcess, messages: list[Any], **extra: Any) -> dict[str, Any]:
    body = {"model": MODEL, "messages": messages, "tools": TOOLS, "max_tokens": 4000, **extra}
    response = httpx.post(emu.url + "/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]  # type: ignore[no-any-return]


def test_a_tool_result_is_answered_in_text(emu: ManagedProcess) -> None:
    messages: list[Any] = [{"role": "user", "content": "Use lookup_capital for France."}]
    first = chat(emu, messages)
    call = first["message"]["tool_calls"][0]
    assert first["finish_reason"] == "tool_calls" and call["id"] == "functions.lookup_capital:0"
    messages += [
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call["id"], "content": "Paris"},
    ]
    second = chat(emu, messages)
    assert second["finish_reason"] == "stop" and second["message"]["content"]
    assert not second["message"].get("tool_calls")
    # "required" still calls, with the next index of the conversation's calls.
    third = chat(emu, messages, tool_choice="required")
    assert third["message"]["tool_calls"][0]["id"] == "functions.lookup_capital:1"


def test_count_tokens_counts_the_chat_prompt(emu: ManagedProcess) -> None:
    body = {
        "model": MODEL,
        "system": "Be brief.",
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
    }
    count = httpx.post(emu.url + "/v1/messages/count_tokens", json=body, timeout=10)
    chat_body = {
        "model": MODEL,
        "messages": [{"role": "system", "content": "Be brief."}, body["messages"][0]],
        "max_tokens": 1,
    }
    answer = httpx.post(emu.url + "/v1/chat/completions", json=chat_body, timeout=10).json()
    assert count.json() == {"input_tokens": answer["usage"]["prompt_tokens"]}
    bad = httpx.post(emu.url + "/v1/messages/count_tokens", json={"model": MODEL}, timeout=10)
    assert bad.status_code == 400
    assert bad.json()["type"] == "error"
    assert bad.json()["error"]["type"] == "invalid_request_error"


def test_only_the_users_own_words_call_a_tool(emu: ManagedProcess) -> None:
    """A tool named in a client's tagged context (Claude Code's system reminders, Codex's
    environment context) or inside another word is not a request to call it."""
    reminder = "<system-reminder>\nAvailable: lookup_capital, Agent.\n</system-reminder>\n"
    context = '<environment_context cwd="/x">lookup_capital</environment_context>'
    for content in (
        [{"type": "text", "text": reminder}, {"type": "text", "text": "Say hello"}],
        context + "\nSay hello",
        "What do lookup_capitals return?",
    ):
        out = chat(emu, [{"role": "user", "content": content}])
        assert out["finish_reason"] == "stop" and not out["message"].get("tool_calls"), content
    own = chat(emu, [{"role": "user", "content": reminder + "Use lookup_capital for Peru."}])
    assert own["finish_reason"] == "tool_calls"
    assert own["message"]["tool_calls"][0]["function"]["name"] == "lookup_capital"
