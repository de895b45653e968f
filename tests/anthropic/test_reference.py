"""The gateway's Messages translator (``app.anthropic.request``) against the emulator's own
conversion (``app.emulator.messages``, written from SGLang's Messages endpoint): for the same
conversation both must give the worker the same prompt, or the tokens ``count_tokens`` reports
(counted by the worker from its own conversion) would not be the ones the request is billed."""

from __future__ import annotations

from typing import Any

import pytest

from app.anthropic.request import translate
from app.emulator.messages import to_chat
from app.emulator.requests import parse_chat

MODEL = "moonshotai/Kimi-K2.5"
USE = {"type": "tool_use", "id": "toolu_1", "name": "lookup", "input": {"city": "Paris"}}
RESULT = {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny, 21C"}
THINKING = {"type": "thinking", "thinking": "The user wants the weather.", "signature": "s"}
IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "QUJD"}}
TOOLS = [{"name": "lookup", "description": "weather", "input_schema": {"type": "object"}}]

CONVERSATIONS: dict[str, dict[str, Any]] = {
    "plain": {"system": "Be brief.", "messages": [{"role": "user", "content": "Hi there"}]},
    "system blocks": {
        "system": [
            {"type": "text", "text": "You are Claude Code."},
            {"type": "text", "text": "Be terse."},
        ],
        "messages": [{"role": "user", "content": [{"type": "text", "text": "ls"}]}],
    },
    "tool round": {
        "tools": TOOLS,
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": [{"type": "text", "text": "Checking."}, USE]},
            {"role": "user", "content": [RESULT]},
        ],
    },
    "thinking in history": {
        "messages": [
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": [THINKING, {"type": "text", "text": "Sunny."}]},
            {"role": "user", "content": "Thanks"},
        ],
    },
    "image": {
        "messages": [{"role": "user", "content": [{"type": "text", "text": "What is it?"}, IMAGE]}]
    },
    "system turn mid-conversation": {
        "system": "Be brief.",
        "messages": [
            {"role": "user", "content": "Fix the bug"},
            {"role": "system", "content": [{"type": "text", "text": "<env>cwd=/repo</env>"}]},
        ],
    },
    "text before and after a tool result": {
        "tools": TOOLS,
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": [USE]},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "Here it is:"},
                    RESULT,
                    {"type": "text", "text": "And tomorrow?"},
                ],
            },
        ],
    },
    "text after a tool result": {
        "tools": TOOLS,
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": [USE]},
            {"role": "user", "content": [RESULT, {"type": "text", "text": "And tomorrow?"}]},
        ],
    },
}


@pytest.mark.parametrize("name", CONVERSATIONS)
def test_the_gateway_sends_the_prompt_the_worker_counts(name: str) -> None:
    body = {"model": MODEL, **CONVERSATIONS[name]}
    sent = parse_chat(translate({**body, "max_tokens": 64}, max_messages=1000).chat)
    counted = parse_chat(to_chat(body))
    assert sent.prompt == counted.prompt
    assert sent.prompt_tokens == counted.prompt_tokens
