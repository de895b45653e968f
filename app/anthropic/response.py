"""A worker's chat completion as an Anthropic Message (non-streamed), and the pieces the stream
translator shares with it: stop reasons and usage.

``finish_reason`` → ``stop_reason``: ``stop`` → ``end_turn`` (``stop_sequence`` when the
worker's ``matched_stop`` is a string: one of the request's stop sequences), ``length`` →
``max_tokens``, ``tool_calls`` → ``tool_use``; anything else (an abort) → ``end_turn``.
``reasoning_content`` becomes a ``thinking`` block (unsigned: ``signature`` is empty), the text
a ``text`` block, each tool call a ``tool_use`` block with the worker's id (Kimi-K2.5's
``functions.NAME:IDX``) and its arguments parsed (a chat completion of any other shape is a
broken worker's: ``UpstreamBadResponse``). Usage: ``input_tokens`` are the prompt tokens
not read from the prefix cache, ``cache_read_input_tokens`` those that were (as SGLang's own
Messages endpoint reports them), ``output_tokens`` the completion tokens.
"""

from __future__ import annotations

from typing import Any

import orjson

from app.errors import UpstreamBadResponse

_STOP = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


def stop_reason(finish: Any, matched: Any) -> tuple[str, str | None]:
    """(``stop_reason``, ``stop_sequence``) for a chat choice's finish."""
    if finish == "stop" and isinstance(matched, str):
        return "stop_sequence", matched
    return _STOP.get(finish, "end_turn") if isinstance(finish, str) else "end_turn", None


def usage_of(usage: Any) -> dict[str, int]:
    """Anthropic's usage for a chat ``usage`` object (zeros when there is none)."""
    if not isinstance(usage, dict):
        return {"input_tokens": 0, "output_tokens": 0}
    prompt = _count(usage.get("prompt_tokens"))
    details = usage.get("prompt_tokens_details")
    cached = _count(details.get("cached_tokens")) if isinstance(details, dict) else 0
    cached = min(cached, prompt)
    out = {"input_tokens": prompt - cached, "output_tokens": _count(usage.get("completion_tokens"))}
    if cached:
        out["cache_read_input_tokens"] = cached
    return out


def _count(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def tool_input(arguments: Any) -> Any:
    """A tool call's ``arguments`` string as the ``input`` object (``{}`` when it is none)."""
    if not isinstance(arguments, str) or not arguments.strip():
        return {}
    try:
        value = orjson.loads(arguments)
    except orjson.JSONDecodeError:
        return {"arguments": arguments}  # what the model wrote, kept for the client to see
    if isinstance(value, dict | list) and _deeper(value, _MAX_INPUT_DEPTH):
        return {"arguments": arguments}  # too deep to write in the Message: kept as text
    return value if isinstance(value, dict) else {"value": value}


# How deep parsed tool arguments may nest in a Message (its encoder stops at 254 levels).
_MAX_INPUT_DEPTH = 64


def _deeper(value: Any, limit: int) -> bool:
    """Whether ``value`` nests more than ``limit`` objects/arrays deep (no recursion)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > limit:
            return True
        children = item.values() if isinstance(item, dict) else item
        stack += [(c, depth + 1) for c in children if isinstance(c, dict | list)]
    return False


def message_id(chat_id: Any) -> str:
    return f"msg_{chat_id}" if isinstance(chat_id, str) and chat_id else "msg_gateway"


def _malformed(where: str) -> UpstreamBadResponse:
    return UpstreamBadResponse(f"the worker's chat completion has a malformed {where}")


def to_message(doc: dict[str, Any], model: str, *, omit_thinking: bool = False) -> dict[str, Any]:
    """The Message for chat completion ``doc``; ``model``: the name the client asked for;
    ``omit_thinking``: its thinking block left empty (``thinking.display: "omitted"``).
    ``UpstreamBadResponse`` for a document without the chat completion's shape where it is
    read (``choices`` a non-empty array of objects, ``message`` an object, its text fields
    strings, ``tool_calls`` an array of objects with an object ``function``): a broken worker's
    answer, retried on another worker."""
    choices = doc.get("choices")
    choice = choices[0] if isinstance(choices, list) and choices else None
    if not isinstance(choice, dict) or not isinstance(choice.get("message"), dict):
        raise _malformed("choices")
    message = choice["message"]
    content: list[dict[str, Any]] = []
    reasoning = message.get("reasoning_content") or message.get("reasoning")  # SGLang / vLLM
    text = message.get("content")
    calls = message.get("tool_calls") or []
    if not isinstance(reasoning, str | None) or not isinstance(text, str | None):
        raise _malformed("message text")
    if not isinstance(calls, list):
        raise _malformed("tool_calls")
    if reasoning:
        shown = "" if omit_thinking else reasoning
        content.append({"type": "thinking", "thinking": shown, "signature": ""})
    if text:
        content.append({"type": "text", "text": text})
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict):
            raise _malformed("tool_calls")
        call_id, name = call.get("id"), function.get("name")
        if not isinstance(call_id, str | None) or not isinstance(name, str | None):
            raise _malformed("tool_calls")
        content.append(
            {
                "type": "tool_use",
                "id": call_id or "",
                "name": name or "",
                "input": tool_input(function.get("arguments")),
            }
        )
    matched = choice.get("matched_stop", choice.get("stop_reason"))  # SGLang / vLLM
    reason, sequence = stop_reason(choice.get("finish_reason"), matched)
    return {
        "id": message_id(doc.get("id")),
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": usage_of(doc.get("usage")),
    }
