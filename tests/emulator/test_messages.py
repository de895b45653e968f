"""The emulator's own Messages conversion (``app.emulator.messages``): a Messages request as the
chat request an SGLang worker's ``/v1/messages`` endpoint turns it into, block by block."""

from __future__ import annotations

from typing import Any

import pytest

from app.emulator.genrequest import RequestError
from app.emulator.messages import to_chat
from app.emulator.requests import parse_chat

MODEL = "moonshotai/Kimi-K2.5"


def chat(messages: list[Any], **extra: Any) -> dict[str, Any]:
    return to_chat({"model": MODEL, "messages": messages, **extra})


def test_system_string_and_blocks_become_one_system_message() -> None:
    assert chat([], system="Be brief.")["messages"] == [{"role": "system", "content": "Be brief."}]
    blocks = [
        {"type": "text", "text": "one"},
        {"type": "text", "text": ""},
        {"type": "text", "text": "two"},
    ]
    assert chat([], system=blocks)["messages"] == [{"role": "system", "content": "one\ntwo"}]


def test_one_text_part_is_a_string_and_several_are_parts() -> None:
    out = chat([{"role": "user", "content": [{"type": "text", "text": "hi"}]}])["messages"]
    assert out == [{"role": "user", "content": "hi"}]
    empty = [{"type": "text", "text": "hi"}, {"type": "text", "text": ""}]  # an empty one counts
    assert chat([{"role": "user", "content": empty}])["messages"][0]["content"] == [
        {"type": "text", "text": "hi"},
        {"type": "text", "text": ""},
    ]
    png = {"type": "base64", "media_type": "image/jpeg", "data": "QUJD"}
    two = [{"type": "text", "text": "look"}, {"type": "image", "source": png}]
    assert chat([{"role": "user", "content": two}])["messages"][0]["content"] == [
        {"type": "text", "text": "look"},
        {"type": "image_url", "image_url": {"url": "data:image/jpeg;base64,QUJD"}},
    ]
    url = {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}
    bare = {"type": "image", "source": {"type": "base64", "data": "QUJD"}}  # no media_type
    parts = chat([{"role": "user", "content": [url, bare]}])["messages"][0]["content"]
    assert [p["image_url"]["url"] for p in parts] == [
        "https://example.com/a.png",
        "data:image/png;base64,QUJD",
    ]


def test_tool_use_and_tool_result_round_trip() -> None:
    use = {"type": "tool_use", "id": "toolu_1", "name": "lookup", "input": {"q": "Paris"}}
    result = {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"}
    out = chat(
        [
            {"role": "user", "content": "weather?"},
            {"role": "assistant", "content": [{"type": "text", "text": "Let me look."}, use]},
            {"role": "user", "content": [{"type": "text", "text": "thanks"}, result]},
        ]
    )["messages"]
    assert out[1] == {
        "role": "assistant",
        "content": "Let me look.",
        "tool_calls": [
            {
                "id": "toolu_1",
                "type": "function",
                "function": {"name": "lookup", "arguments": '{"q": "Paris"}'},
            }
        ],
    }
    # A user's tool result is a tool message; what the user wrote before it comes first.
    assert out[2:] == [
        {"role": "user", "content": "thanks"},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"},
    ]
    after = chat([{"role": "user", "content": [result, {"type": "text", "text": "and?"}]}])
    assert after["messages"] == [
        {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"},
        {"role": "user", "content": "and?"},
    ]


def test_a_tool_result_with_parts_and_in_another_role() -> None:
    texts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    result = {"type": "tool_result", "tool_use_id": "t", "content": texts}
    out = chat([{"role": "user", "content": [result]}])["messages"]
    assert out == [{"role": "tool", "tool_call_id": "t", "content": texts}]
    single = {"type": "tool_result", "tool_use_id": "t", "content": texts[:1]}
    assert chat([{"role": "user", "content": [single]}])["messages"][0]["content"] == "a"
    # Outside a user's turn it stays in the turn, as text.
    out = chat([{"role": "assistant", "content": [result]}])["messages"]
    assert out == [{"role": "assistant", "content": "Tool result: a\nb"}]


def test_thinking_is_the_assistants_reasoning_and_empty_turns() -> None:
    thinking = {"type": "thinking", "thinking": "hmm", "signature": "x"}
    out = chat(
        [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": [thinking, {"type": "text", "text": "hello"}]},
            {"role": "user", "content": [{"type": "document", "source": {}}]},
            {"role": "assistant", "content": [{"type": "document", "source": {}}]},
        ]
    )["messages"]
    assert out == [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "reasoning_content": "hmm", "content": "hello"},
        {"role": "assistant", "content": ""},  # an empty assistant turn stays, a user's does not
    ]
    redacted = {"type": "redacted_thinking", "data": "..."}
    with pytest.raises(RequestError, match="redacted_thinking"):
        chat([{"role": "assistant", "content": [redacted]}])
    off = chat([{"role": "user", "content": "hi"}], thinking={"type": "disabled"})
    assert off["chat_template_kwargs"] == {"thinking": False}


def test_a_system_turn_inside_the_conversation_stays_in_place() -> None:
    out = chat(
        [
            {"role": "user", "content": "hi"},
            {"role": "system", "content": [{"type": "text", "text": "<env>cwd=/x</env>"}]},
        ],
        system="Be brief.",
    )["messages"]
    assert [m["role"] for m in out] == ["system", "user", "system"]
    assert out[2]["content"] == "<env>cwd=/x</env>"


def test_tools_and_tool_choice() -> None:
    tool = {"name": "lookup", "input_schema": {"type": "object"}}
    body = chat([{"role": "user", "content": "hi"}], tools=[tool])
    assert body["tools"] == [
        {
            "type": "function",
            "function": {"name": "lookup", "description": "", "parameters": {"type": "object"}},
        }
    ]
    assert body["tool_choice"] == "auto"
    pick = {"type": "tool", "name": "lookup"}
    assert chat([], tools=[tool], tool_choice=pick)["tool_choice"] == {
        "type": "function",
        "function": {"name": "lookup"},
    }
    assert chat([], tools=[tool], tool_choice={"type": "any"})["tool_choice"] == "required"
    assert chat([], tool_choice={"type": "none"})["tool_choice"] == "none"
    assert "tool_choice" not in chat([], tool_choice={"type": "auto"})  # no tools: nothing
    search = {"type": "web_search_20250305", "name": "web_search"}  # a server tool: skipped
    assert "tools" not in chat([], tools=[search])
    for required in ({"type": "any"}, {"type": "tool", "name": "web_search"}):
        with pytest.raises(RequestError):
            chat([], tools=[search], tool_choice=required)
    with pytest.raises(RequestError, match="not in tools"):
        chat([], tools=[tool], tool_choice={"type": "tool", "name": "other"})


@pytest.mark.parametrize(
    "body",
    [
        [],
        {"messages": []},
        {"model": MODEL},
        {"model": MODEL, "messages": "hi"},
        {"model": MODEL, "messages": [{"role": "tool", "content": "x"}]},
        {"model": MODEL, "messages": [{"role": "user", "content": 7}]},
        {"model": MODEL, "messages": [{"role": "user", "content": [{"text": "no type"}]}]},
        {"model": MODEL, "messages": [], "system": 3},
        {"model": MODEL, "messages": [], "tools": [{"input_schema": {}}]},
        {"model": MODEL, "messages": [], "tool_choice": {"type": "maybe"}},
    ],
)
def test_what_is_not_a_messages_request_is_refused(body: Any) -> None:
    with pytest.raises(RequestError):
        to_chat(body)


def test_the_count_is_the_rendered_chat_prompts() -> None:
    """count_tokens counts what the chat endpoint would: the same conversation sent as chat
    reports the same prompt tokens."""
    body = chat([{"role": "user", "content": "What is the capital of France?"}], system="Brief.")
    direct = {
        "messages": [
            {"role": "system", "content": "Brief."},
            {"role": "user", "content": "What is the capital of France?"},
        ]
    }
    assert parse_chat(body).prompt_tokens == parse_chat(direct).prompt_tokens
