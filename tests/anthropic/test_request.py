"""Messages request → chat-completions body, and chat completion → Message."""

from __future__ import annotations

import re
from typing import Any

import pytest

from app.anthropic.request import load, translate
from app.anthropic.response import to_message
from app.errors import InvalidRequest

MODEL = "moonshotai/Kimi-K2.5"


def chat(body: dict[str, Any], **kw: Any) -> dict[str, Any]:
    return translate({"model": MODEL, "max_tokens": 100, **body}, max_messages=50, **kw).chat


def test_system_blocks_images_and_cache_control_dropped() -> None:
    out = chat(
        {
            "system": [
                {"type": "text", "text": "A", "cache_control": {"type": "ephemeral"}},
                {"type": "text", "text": "B"},
            ],
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "look", "cache_control": {"type": "ephemeral"}},
                        {
                            "type": "image",
                            "source": {"type": "base64", "media_type": "image/png", "data": "QUJD"},
                        },
                        {
                            "type": "image",
                            "source": {"type": "url", "url": "https://img.example.com/y.png"},
                        },
                    ],
                }
            ],
            "service_tier": "auto",
            "container": "c",
        }
    )
    assert out == {
        "model": MODEL,
        "messages": [
            {"role": "system", "content": "A\nB"},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "look"},
                    {"type": "image_url", "image_url": {"url": "data:image/png;base64,QUJD"}},
                    {"type": "image_url", "image_url": {"url": "https://img.example.com/y.png"}},
                ],
            },
        ],
        "max_tokens": 100,
    }


def test_tool_round_trip_history_keeps_ids_and_reasoning() -> None:
    out = chat(
        {
            "messages": [
                {"role": "user", "content": "weather?"},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "thinking", "thinking": "need a tool", "signature": "s"},
                        {"type": "redacted_thinking", "data": "xyz"},
                        {"type": "text", "text": "Let me check."},
                        {
                            "type": "tool_use",
                            "id": "functions.get_weather:0",
                            "name": "get_weather",
                            "input": {"city": "Paris"},
                        },
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "before"},
                        {
                            "type": "tool_result",
                            "tool_use_id": "functions.get_weather:0",
                            "content": [{"type": "text", "text": "Sunny"}],
                        },
                        {"type": "text", "text": "thanks"},
                    ],
                },
            ]
        }
    )
    assert out["messages"][1:] == [
        {
            "role": "assistant",
            "content": "Let me check.",
            "reasoning_content": "need a tool",
            "tool_calls": [
                {
                    "id": "functions.get_weather:0",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "user", "content": "before"},
        {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "Sunny"},
        {"role": "user", "content": "thanks"},
    ]


@pytest.mark.parametrize(
    ("choice", "expected"),
    [
        ({"type": "auto"}, {"tool_choice": "auto"}),
        ({"type": "any"}, {"tool_choice": "required"}),
        ({"type": "none"}, {"tool_choice": "none"}),
        (
            {"type": "tool", "name": "f", "disable_parallel_tool_use": True},
            {
                "tool_choice": {"type": "function", "function": {"name": "f"}},
                "parallel_tool_calls": False,
            },
        ),
    ],
)
def test_tools_and_tool_choice(choice: dict[str, Any], expected: dict[str, Any]) -> None:
    out = chat(
        {
            "messages": [{"role": "user", "content": "x"}],
            "tools": [
                {
                    "name": "f",
                    "description": "does f",
                    "input_schema": {"type": "object"},
                    "cache_control": {"type": "ephemeral"},
                },
                {"type": "web_search_20250305", "name": "web_search"},  # Anthropic runs it
            ],
            "tool_choice": choice,
        }
    )
    function = {"name": "f", "parameters": {"type": "object"}, "description": "does f"}
    assert out["tools"] == [{"type": "function", "function": function}]
    assert {k: out[k] for k in expected} == expected


def test_sampling_thinking_user_and_stream() -> None:
    body = {
        "messages": [{"role": "user", "content": "x"}],
        "stop_sequences": ["END"],
        "temperature": 0.5,
        "top_p": 0.9,
        "top_k": 20,
        "metadata": {"user_id": "u-1"},
        "stream": True,
    }
    out = chat({**body, "thinking": {"type": "enabled", "budget_tokens": 1024}})
    assert out["stop"] == ["END"] and out["user"] == "u-1"
    assert (out["temperature"], out["top_p"], out["top_k"]) == (0.5, 0.9, 20)
    assert out["chat_template_kwargs"] == {"thinking": True}
    assert out["stream"] is True and out["stream_options"] == {"include_usage": True}
    assert chat({**body, "thinking": {"type": "disabled"}})["chat_template_kwargs"] == {
        "thinking": False
    }
    assert "chat_template_kwargs" not in chat(body)  # the model's default


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": [{"role": "user", "content": "x"}], "max_tokens": None}, "max_tokens"),
        ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, "max_tokens"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages.0.role"),
        (
            {"messages": [{"role": "system", "content": [{"type": "image"}]}]},
            "messages.0.content.0",
        ),
        (
            {
                "messages": [{"role": "user", "content": "x"}],
                "context_management": {"edits": [{"type": "clear_tool_uses_20250919"}]},
            },
            "context_management",
        ),
        (
            {"messages": [{"role": "user", "content": "x"}], "output_format": {"type": "x"}},
            "output_format",
        ),
        (
            {"messages": [{"role": "user", "content": "x"}], "output_config": {"task": 1}},
            "output_config",
        ),
        (
            {
                "messages": [{"role": "user", "content": "x"}],
                "thinking": {"type": "adaptive", "display": 1},
            },
            "thinking",
        ),
        ({"messages": [{"role": "user", "content": 3}]}, "messages.0.content"),
        ({"messages": [{"role": "user", "content": [{"type": "video"}]}]}, "messages.0.content.0"),
        ({"messages": [{"role": "user", "content": "x"}] * 51}, "messages"),
        (
            {"messages": [{"role": "user", "content": "x"}], "tool_choice": {"type": "any"}},
            "tool_choice",
        ),
        ({"messages": [{"role": "user", "content": "x"}], "thinking": {"type": "on"}}, "thinking"),
        ({"messages": [{"role": "user", "content": "x"}], "system": 5}, "system"),
    ],
)
def test_refused_with_a_400_naming_the_field(body: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequest) as refused:
        translate({"model": MODEL, "max_tokens": 10, **body}, max_messages=50)
    assert refused.value.status == 400 and refused.value.param == param


def test_count_only_needs_no_max_tokens() -> None:
    out = translate(
        {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "stream": True},
        max_messages=5,
        count_only=True,
    )
    assert out.chat == {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}
    assert out.stream is False


def test_body_must_be_a_json_object() -> None:
    for raw in (b"[1]", b"{nope"):
        with pytest.raises(InvalidRequest):
            load(raw)


def test_chat_completion_as_message() -> None:
    doc = {
        "id": "abc",
        "choices": [
            {
                "message": {
                    "role": "assistant",
                    "content": "",
                    "reasoning_content": "hmm",
                    "tool_calls": [
                        {
                            "id": "functions.f:3",
                            "type": "function",
                            "function": {"name": "f", "arguments": '{"a": 1}'},
                        }
                    ],
                },
                "finish_reason": "tool_calls",
                "matched_stop": None,
            }
        ],
        "usage": {
            "prompt_tokens": 100,
            "completion_tokens": 7,
            "prompt_tokens_details": {"cached_tokens": 60},
        },
    }
    assert to_message(doc, "kimi") == {
        "id": "msg_abc",
        "type": "message",
        "role": "assistant",
        "model": "kimi",
        "content": [
            {"type": "thinking", "thinking": "hmm", "signature": ""},
            {"type": "tool_use", "id": "functions.f:3", "name": "f", "input": {"a": 1}},
        ],
        "stop_reason": "tool_use",
        "stop_sequence": None,
        "usage": {"input_tokens": 40, "output_tokens": 7, "cache_read_input_tokens": 60},
    }


@pytest.mark.parametrize(
    ("finish", "matched", "reason", "sequence"),
    [
        ("stop", 163586, "end_turn", None),
        ("stop", "END", "stop_sequence", "END"),
        ("length", None, "max_tokens", None),
        ("abort", None, "end_turn", None),
    ],
)
def test_stop_reasons(finish: str, matched: Any, reason: str, sequence: str | None) -> None:
    doc = {"choices": [{"message": {"content": "hi"}, "finish_reason": finish,
                        "matched_stop": matched}]}  # fmt: skip
    message = to_message(doc, "m")
    assert (message["stop_reason"], message["stop_sequence"]) == (reason, sequence)
    assert message["content"] == [{"type": "text", "text": "hi"}]


def test_the_first_dropped_field_is_named() -> None:
    body = {"model": MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]}
    assert translate(body, max_messages=5).dropped is None
    assert translate({**body, "container": "c", "rid": "r"}, max_messages=5).dropped == "container"
    assert translate(body, max_messages=5, count_only=True).dropped == "max_tokens"


def test_system_turns_stay_where_the_client_put_them() -> None:
    """Claude Code's environment block comes as a system-role entry after the user's turn."""
    out = chat(
        {
            "system": "You are an agent.",
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "Say hello"}]},
                {
                    "role": "system",
                    "content": [
                        {"type": "text", "text": "# Environment", "cache_control": {"type": "x"}}
                    ],
                },
                {"role": "assistant", "content": "Hello!"},
                {"role": "system", "content": "  "},  # nothing to say: left out
                {
                    "role": "system",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                },
            ],
        }
    )
    assert out["messages"] == [
        {"role": "system", "content": "You are an agent."},
        {"role": "user", "content": "Say hello"},
        {"role": "system", "content": "# Environment"},
        {"role": "assistant", "content": "Hello!"},
        {
            "role": "system",
            "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
        },
    ]


def test_claude_codes_other_fields() -> None:
    """What Claude Code 2.1 sends besides the conversation: none is a 400, none is lost when it
    changes the answer."""
    body: dict[str, Any] = {
        "messages": [{"role": "user", "content": "x"}],
        "metadata": {"user_id": '{"device_id":"d","session_id":"s"}'},
        "thinking": {"type": "adaptive", "display": "omitted"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "output_config": {"effort": "high"},
        "tools": [
            {"name": "Read", "input_schema": {"type": "object"}},
            {"name": "Later", "input_schema": {"type": "object"}, "defer_loading": True},
        ],
    }
    translated = translate({"model": MODEL, "max_tokens": 100, **body}, max_messages=5)
    out = translated.chat
    assert translated.dropped is None and translated.omit_thinking
    assert out["chat_template_kwargs"] == {"thinking": True}
    assert out["user"] == body["metadata"]["user_id"]  # one session, one worker
    assert [t["function"]["name"] for t in out["tools"]] == ["Read", "Later"]
    assert "response_format" not in out
    for display in (None, "summarized", "updates"):  # Claude Code asks for updates in -p mode
        thinking = {"type": "adaptive", "display": display}
        again = translate(
            {"model": MODEL, "max_tokens": 9, **body, "thinking": thinking}, max_messages=5
        )
        assert not again.omit_thinking and again.chat["chat_template_kwargs"] == {"thinking": True}


def test_output_format_becomes_the_workers_json_schema() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    expected = {
        "type": "json_schema",
        "json_schema": {"name": "output", "schema": schema, "strict": True},
    }
    base = {"messages": [{"role": "user", "content": "x"}]}
    fmt = {"type": "json_schema", "schema": schema}
    assert chat({**base, "output_format": fmt})["response_format"] == expected
    assert chat({**base, "output_config": {"format": fmt}})["response_format"] == expected


def test_clear_thinking_keeps_the_last_turns_thinking() -> None:
    def turn(n: int) -> list[dict[str, Any]]:
        return [
            {"role": "user", "content": f"q{n}"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": f"t{n}", "signature": ""},
                    {"type": "text", "text": f"a{n}"},
                ],
            },
        ]

    messages = [*turn(1), *turn(2), *turn(3), {"role": "user", "content": "q4"}]

    def kept(keep: Any) -> list[str]:
        edit: dict[str, Any] = {"type": "clear_thinking_20251015"}
        if keep is not None:
            edit["keep"] = keep
        out = chat({"messages": messages, "context_management": {"edits": [edit]}})
        return [m["reasoning_content"] for m in out["messages"] if "reasoning_content" in m]

    assert kept("all") == ["t1", "t2", "t3"]
    assert kept(None) == ["t3"]  # Anthropic's default: the last turn's
    assert kept({"type": "thinking_turns", "value": 2}) == ["t2", "t3"]
    assert kept({"type": "thinking_turns", "value": 0}) == []


def test_an_unsupported_context_edit_is_refused_as_claude_code_understands() -> None:
    """Claude Code stops sending ``clear_tool_uses`` to a model whose API refuses it with this
    wording (its own check, on the error's message)."""
    body = {
        "model": MODEL,
        "max_tokens": 10,
        "messages": [{"role": "user", "content": "x"}],
        "context_management": {"edits": [{"type": "clear_tool_uses_20250919"}]},
    }
    with pytest.raises(InvalidRequest) as refused:
        translate(body, max_messages=5)
    assert re.search(r"clear_tool_uses_20250919\W? context management strategy", str(refused.value))
