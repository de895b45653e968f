"""The Responses → chat translation (``app.responses.request``): what each item and field becomes,
and what is refused with a 400 naming it."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from app.errors import InvalidRequest
from app.responses.request import MAX_DEPTH, load, translate

MODEL = "moonshotai/Kimi-K2.5"
IMAGE = "data:image/png;base64,x"


def chat(body: dict[str, Any], **kw: Any) -> dict[str, Any]:
    return translate({"model": MODEL, **body}, max_messages=100, **kw).chat


def refused(body: dict[str, Any]) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as caught:
        translate({"model": MODEL, **body}, max_messages=100)
    return caught.value


def test_a_string_input_and_instructions() -> None:
    out = chat({"input": "Hi", "instructions": "Be brief.", "max_output_tokens": 9})
    assert out["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
    ]
    assert out["max_tokens"] == 9 and "stream" not in out


def test_items_become_turns_with_calls_paired_and_reasoning_folded() -> None:
    items = [
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "D"}]},
        {"role": "user", "content": [{"type": "input_text", "text": "Look"},
                                     {"type": "input_image", "image_url": IMAGE}]},
        {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "think"}]},
        {"type": "message", "role": "assistant",
         "content": [{"type": "output_text", "text": "Let me check."}]},
        {"type": "function_call", "call_id": "c1", "name": "ls", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "spawn_agent", "namespace": "agents",
         "arguments": "{\"x\":1}"},
        {"type": "function_call_output", "call_id": "c1", "output": "a.txt"},
        {"type": "function_call_output", "call_id": "c2",
         "output": [{"type": "input_text", "text": "done"}]},
    ]  # fmt: skip
    messages = chat({"input": items})["messages"]
    assert messages[0] == {"role": "system", "content": "D"}
    assert messages[1]["content"][1] == {
        "type": "image_url",
        "image_url": {"url": "data:image/png;base64,x"},
    }
    assistant = messages[2]
    assert assistant["content"] == "Let me check." and assistant["reasoning_content"] == "think"
    assert [call["id"] for call in assistant["tool_calls"]] == ["c1", "c2"]
    assert assistant["tool_calls"][1]["function"] == {
        "name": "agents.spawn_agent",
        "arguments": '{"x":1}',
    }
    assert messages[3:] == [
        {"role": "tool", "tool_call_id": "c1", "content": "a.txt"},
        {"role": "tool", "tool_call_id": "c2", "content": "done"},
    ]


def test_tools_namespaces_choice_and_formats() -> None:
    tools = [
        {"type": "function", "name": "ls", "parameters": {"type": "object"}, "strict": True},
        {"type": "namespace", "name": "agents", "description": "Sub-agents.",
         "tools": [{"type": "function", "name": "spawn_agent", "description": "Spawn."}]},
    ]  # fmt: skip
    translated = translate(
        {
            "model": MODEL,
            "input": "x",
            "tools": tools,
            "tool_choice": {"type": "function", "name": "ls"},
            "parallel_tool_calls": False,
            "text": {"format": {"type": "json_schema", "name": "out", "schema": {"type": "object"},
                                "strict": True}},
            "reasoning": {"effort": "none", "summary": "auto"},
            "user": "u1",
            "stream": True,
        },
        max_messages=100,
    )  # fmt: skip
    out = translated.chat
    assert [t["function"]["name"] for t in out["tools"]] == ["ls", "agents.spawn_agent"]
    assert out["tools"][0]["function"]["strict"] is True
    assert translated.names == {"agents.spawn_agent": ("agents", "spawn_agent")}
    assert out["tool_choice"] == {"type": "function", "function": {"name": "ls"}}
    assert out["parallel_tool_calls"] is False
    assert out["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "out", "schema": {"type": "object"}, "strict": True},
    }
    assert out["chat_template_kwargs"] == {"thinking": False}
    assert translated.summary is True
    assert out["user"] == "u1" and out["stream_options"] == {"include_usage": True}


def test_thinking_switch_and_routing_key() -> None:
    assert chat({"input": "x", "reasoning": {"effort": "low"}})["chat_template_kwargs"] == {
        "thinking": True
    }
    plain = chat({"input": "x", "prompt_cache_key": "session-9"})
    assert "chat_template_kwargs" not in plain  # the model's default: it thinks
    assert plain["user"] == "session-9"


def test_codex_fields_are_understood_and_unknown_ones_named() -> None:
    body = {"model": MODEL, "input": "x", "store": False}
    body |= {"include": ["reasoning.encrypted_content"]}
    body |= {"client_metadata": {"a": "b"}, "prompt_cache_key": "k", "service_tier": "auto"}
    assert translate(body, max_messages=10).dropped is None
    assert translate({**body, "frobnicate": 1}, max_messages=10).dropped == "frobnicate"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools.0"),
        ({"input": "x", "tools": [{"type": "custom", "name": "p",
                                   "format": {"type": "grammar", "syntax": "peg",
                                              "definition": "x"}}]}, "tools.0"),
        ({"input": "x", "tools": [{"type": "custom", "name": "p",
                                   "format": {"type": "grammar", "syntax": "lark"}}]}, "tools.0"),
        ({"input": "x", "tools": [{"type": "custom"}]}, "tools.0"),
        ({"input": [{"type": "custom_tool_call", "call_id": "c", "name": "p"}]}, "input.0"),
        ({"input": "x", "tools": [{"type": "custom", "name": "p"}],
          "tool_choice": {"type": "custom", "name": "q"}}, "tool_choice"),
        ({"input": "x", "tools": [{"type": "custom", "name": "p"}],
          "tool_choice": {"type": "function", "name": "p"}}, "tool_choice"),
        ({"input": "x", "tools": [{"type": "function", "name": "f"}],
          "tool_choice": {"type": "custom", "name": "f"}}, "tool_choice"),
        ({"input": [{"type": "item_reference", "id": "i"}]}, "input.0"),
        ({"input": [{"type": "local_shell_call"}]}, "input.0"),
        ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
         "input.0.content.0"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}]},
         "input.0.content.0"),
        ({"input": [{"role": "assistant", "content": [{"type": "input_image",
                                                        "image_url": "u"}]}]}, "input.0.content.0"),
        ({"input": "x", "background": True}, "background"),
        ({"input": "x", "conversation": "c"}, "conversation"),
        ({"input": "x", "truncation": "auto"}, "truncation"),
        ({"input": "x", "top_logprobs": 2}, "top_logprobs"),
        ({"input": "x", "include": ["message.output_text.logprobs"]}, "include"),
        ({"input": "x", "tool_choice": "required"}, "tool_choice"),
        ({"input": "x", "tool_choice": {"type": "web_search"}}, "tool_choice"),
        ({"input": "x", "reasoning": {"effort": "turbo"}}, "reasoning"),
        ({"input": "x", "text": {"format": {"type": "xml"}}}, "text"),
        ({"input": "x", "max_output_tokens": True}, "max_output_tokens"),
        ({"input": []}, "input"),
        ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input.0"),
    ],
)  # fmt: skip
def test_what_cannot_be_honoured_is_refused_naming_it(body: dict[str, Any], param: str) -> None:
    assert refused(body).param == param


def test_custom_tools_become_one_string_argument_functions_and_come_back_as_calls() -> None:
    grammar = {"type": "grammar", "syntax": "lark", "definition": 'start: "*** Begin Patch"'}
    tools = [
        {"type": "custom", "name": "apply_patch", "description": "Edit files.", "format": grammar},
        {"type": "custom", "name": "note"},
    ]
    items = [
        {"role": "user", "content": "Patch it."},
        {"type": "custom_tool_call", "call_id": "c1", "name": "apply_patch", "input": 'a "b"\n'},
        {"type": "custom_tool_call_output", "call_id": "c1", "output": "Done!"},
    ]
    out = translate(
        {"model": MODEL, "input": items, "tools": tools,
         "tool_choice": {"type": "custom", "name": "note"}},
        max_messages=100,
    )  # fmt: skip
    patch, note = (tool["function"] for tool in out.chat["tools"])
    assert patch["name"] == "apply_patch" and patch["description"].startswith("Edit files.")
    assert "Lark grammar" in patch["description"] and "*** Begin Patch" in patch["description"]
    assert patch["parameters"]["required"] == ["input"]
    assert patch["parameters"]["properties"]["input"]["type"] == "string"
    assert "description" not in note and note["parameters"]["required"] == ["input"]
    assert out.custom == {"apply_patch", "note"}
    assert out.chat["tool_choice"] == {"type": "function", "function": {"name": "note"}}
    call = out.chat["messages"][1]["tool_calls"][0]
    assert call["id"] == "c1" and call["function"]["name"] == "apply_patch"
    assert orjson.loads(call["function"]["arguments"]) == {"input": 'a "b"\n'}
    assert out.chat["messages"][2] == {"role": "tool", "tool_call_id": "c1", "content": "Done!"}


def test_history_continues_and_counts_against_the_message_cap() -> None:
    history = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    out = translate({"model": MODEL, "input": "c"}, max_messages=4, history=history)
    assert [m["content"] for m in out.chat["messages"]] == ["a", "b", "c"]
    assert out.conversation == out.chat["messages"]
    with pytest.raises(InvalidRequest):
        translate({"model": MODEL, "input": "c"}, max_messages=3, history=history)


def test_load_bounds_memory_and_depth() -> None:
    assert load(b'{"model": "m"}') == {"model": "m"}
    nested: Any = "x"
    for _ in range(MAX_DEPTH + 1):
        nested = [nested]
    for raw in (
        b"[1]",
        b"{",
        orjson.dumps({"input": nested}),
        b'{"input":[' + b",".join([b"[]"] * 300_000) + b"]}",
        b'{"input":[' + b",".join([b'""'] * 300_000) + b"]}",
        b'{"input":[' + b",".join([b"1.5"] * 300_000) + b"]}",
    ):
        with pytest.raises(InvalidRequest):
            load(raw)
    # A large body of real text is not refused by the estimate.
    text = "word " * 400_000
    assert load(orjson.dumps({"input": text}))["input"] == text
