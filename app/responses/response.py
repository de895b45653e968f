"""The Response object: its frame (``frame``), its usage, its output items, and a worker's whole
chat completion as one (``to_response``, non-streamed).

A chat completion's message becomes up to three kinds of output items, in the order the model
produced them: ``reasoning`` (from ``reasoning_content``: as a ``summary_text`` when the request
asked for a reasoning summary, else as ``reasoning_text`` content; ``encrypted_content`` is
always null), ``message`` (the text as one ``output_text`` part) and one ``function_call`` per
tool call (the worker's call id is the ``call_id``; a flattened namespace tool gets its name and
``namespace`` back; a custom tool's call is a ``custom_tool_call`` with its ``input`` instead).
``finish_reason: length`` makes the response ``incomplete`` with
``incomplete_details.reason = max_output_tokens``. Usage: ``input_tokens`` = prompt tokens
(``input_tokens_details.cached_tokens`` the prefix-cache hits the worker reports),
``output_tokens`` = completion tokens (``output_tokens_details.reasoning_tokens`` as reported).

A chat completion that is not one (``choices`` not a list of objects, a message or call of the
wrong types) is the worker's failure (``UpstreamBadResponse``: retried on another worker), never
a 500.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from app.errors import UpstreamBadResponse
from app.responses.custom import arguments_of, input_of
from app.upstream.usage import reported_count


@dataclass(slots=True)
class Context:
    """One Responses request, as every attempt's translation of it needs it."""

    model: str  # as the client named it
    echo: dict[str, Any]  # the request's settings the Response repeats
    names: dict[str, tuple[str, str]]  # flattened tool name → (namespace, name)
    summary: bool  # reasoning as summary_text (else reasoning_text)
    custom: frozenset[str] = frozenset()  # the custom (free-form) tools' names
    id: str = field(default_factory=lambda: "resp_" + secrets.token_hex(16))
    created_at: int = field(default_factory=lambda: int(time.time()))
    # Called with the final Response (completed or incomplete), e.g. to store it.
    on_final: Callable[[dict[str, Any]], None] | None = None
    current: Any = None  # the running attempt's stream translator (``stream.ResponsesStream``)

    def item_id(self, prefix: str, index: int) -> str:
        return f"{prefix}_{self.id[5:]}{index:04x}"


def frame(ctx: Context, status: str) -> dict[str, Any]:
    """The Response object without output and usage."""
    echo = ctx.echo
    return {
        "id": ctx.id,
        "object": "response",
        "created_at": ctx.created_at,
        "status": status,
        "background": False,
        "error": None,
        "incomplete_details": None,
        "instructions": echo.get("instructions"),
        "max_output_tokens": echo.get("max_output_tokens"),
        "metadata": echo.get("metadata") or {},
        "model": ctx.model,
        "output": [],
        "parallel_tool_calls": echo.get("parallel_tool_calls", True),
        "previous_response_id": echo.get("previous_response_id"),
        "reasoning": echo.get("reasoning"),
        "service_tier": "default",
        "temperature": echo.get("temperature"),
        "text": echo.get("text") or {"format": {"type": "text"}},
        "tool_choice": echo.get("tool_choice", "auto"),
        "tools": echo.get("tools") or [],
        "top_p": echo.get("top_p"),
        "truncation": "disabled",
        "usage": None,
        "user": echo.get("user"),
    }


def usage_of(usage: Any) -> dict[str, Any] | None:
    """The Responses usage for a chat ``usage`` object (None when there is none)."""
    if not isinstance(usage, dict):
        return None
    prompt = reported_count(usage.get("prompt_tokens")) or 0
    completion = reported_count(usage.get("completion_tokens")) or 0
    details = usage.get("prompt_tokens_details")
    cached = reported_count(details.get("cached_tokens")) if isinstance(details, dict) else None
    reasoning = usage.get("reasoning_tokens")
    out_details = usage.get("completion_tokens_details")
    if reasoning is None and isinstance(out_details, dict):
        reasoning = out_details.get("reasoning_tokens")
    return {
        "input_tokens": prompt,
        "input_tokens_details": {
            "cached_tokens": min(cached or 0, prompt),
            "cache_write_tokens": 0,
        },
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": reported_count(reasoning) or 0},
        "total_tokens": prompt + completion,
    }


def finish(response: dict[str, Any], finish_reason: Any) -> None:
    """Status and ``incomplete_details`` for the worker's ``finish_reason``."""
    if finish_reason == "length":
        response["status"] = "incomplete"
        response["incomplete_details"] = {"reason": "max_output_tokens"}
    else:
        response["status"] = "completed"
        response["completed_at"] = int(time.time())


def reasoning_item(ctx: Context, index: int, text: str, status: str) -> dict[str, Any]:
    item: dict[str, Any] = {"id": ctx.item_id("rs", index), "type": "reasoning"}
    if ctx.summary:
        item["summary"] = [{"type": "summary_text", "text": text}]
    else:
        item["summary"] = []
        item["content"] = [{"type": "reasoning_text", "text": text}]
    item["encrypted_content"] = None
    item["status"] = status
    return item


def output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(ctx: Context, index: int, text: str, status: str) -> dict[str, Any]:
    return {
        "id": ctx.item_id("msg", index),
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": [output_text(text)] if status != "in_progress" else [],
    }


def call_item(
    ctx: Context, index: int, call_id: str, name: str, arguments: str, status: str
) -> dict[str, Any]:
    if name in ctx.custom:
        return {
            "id": ctx.item_id("ctc", index),
            "type": "custom_tool_call",
            "call_id": call_id,
            "name": name,
            "input": input_of(arguments) if arguments else "",
            "status": status,
        }
    item: dict[str, Any] = {
        "id": ctx.item_id("fc", index),
        "type": "function_call",
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }
    spaced = ctx.names.get(name)
    if spaced is not None:
        item["namespace"], item["name"] = spaced
    return item


def _bad(what: str) -> UpstreamBadResponse:
    return UpstreamBadResponse(f"a worker sent a chat completion with {what}")


def _optional_str(value: Any, what: str) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        raise _bad(what)
    return value


def to_response(doc: dict[str, Any], ctx: Context) -> dict[str, Any]:
    """The Response for chat completion ``doc``."""
    choices = doc.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise _bad("no choice")
    choice = choices[0]
    message = choice.get("message")
    if not isinstance(message, dict):
        raise _bad("a choice without a message")
    output: list[dict[str, Any]] = []
    reasoning = message.get("reasoning_content")
    if reasoning is None:  # vLLM's name for it
        reasoning = message.get("reasoning")
    reasoning = _optional_str(reasoning, "a non-string reasoning_content")
    if reasoning:
        output.append(reasoning_item(ctx, len(output), reasoning, "completed"))
    text = _optional_str(message.get("content"), "a non-string content")
    if text:
        output.append(message_item(ctx, len(output), text, "completed"))
    calls = message.get("tool_calls") or []
    if not isinstance(calls, list):
        raise _bad("tool_calls that are not a list")
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict):
            raise _bad("a tool call without a function")
        call_id = _optional_str(call.get("id"), "a non-string tool call id")
        name = _optional_str(function.get("name"), "a non-string tool name")
        arguments = _optional_str(function.get("arguments"), "non-string tool arguments")
        output.append(call_item(ctx, len(output), call_id, name, arguments, "completed"))
    response = frame(ctx, "completed")
    response["output"] = output
    finish(response, choice.get("finish_reason"))
    if response["status"] == "incomplete" and output:
        output[-1]["status"] = "incomplete"
    response["usage"] = usage_of(doc.get("usage"))
    return response


def assistant_turn(response: dict[str, Any], ctx: Context) -> dict[str, Any] | None:
    """A response's output as the chat assistant turn a later request continues from."""
    turn: dict[str, Any] = {"role": "assistant"}
    texts: list[str] = []
    reasoning: list[str] = []
    calls: list[dict[str, Any]] = []
    for item in response.get("output") or ():
        kind = item.get("type")
        if kind == "message":
            texts += [part["text"] for part in item.get("content") or ()]
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or ()
            reasoning += [part["text"] for part in parts]
        elif kind == "function_call":
            name = item["name"]
            if item.get("namespace"):
                name = f"{item['namespace']}.{name}"
            function = {"name": name, "arguments": item["arguments"]}
            calls.append({"id": item["call_id"], "type": "function", "function": function})
        elif kind == "custom_tool_call":
            function = {"name": item["name"], "arguments": arguments_of(item["input"])}
            calls.append({"id": item["call_id"], "type": "function", "function": function})
    if not (texts or reasoning or calls):
        return None
    if reasoning:
        turn["reasoning_content"] = "\n".join(reasoning)
    if texts or not calls:
        turn["content"] = "".join(texts)
    if calls:
        turn["tool_calls"] = calls
    return turn
