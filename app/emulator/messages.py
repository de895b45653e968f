"""An Anthropic Messages request as the chat request it stands for, converted the way an SGLang
worker's own ``/v1/messages`` endpoint converts it (SGLang 0.5.23,
``sglang/srt/entrypoints/anthropic/serving.py``) before its chat template renders it, for
``count_tokens`` (``counting.py``).

Written from SGLang's behaviour and Anthropic's request shape, and independent of the gateway's
own translator (``app.anthropic.request``): the emulator is the reference that translator is
tested against (tests/anthropic/test_reference.py), so a mistake there shows as a disagreement
instead of being repeated here.

- ``system``: a string (unless blank) or the texts of its text blocks, joined by newlines, as one
  system message. A ``system`` turn inside ``messages`` (how Claude Code sends operator context)
  stays a system message in its place: Kimi-K2.5's template renders system turns anywhere.
- A turn whose content is a string stays as it is. A list of blocks becomes content parts:
  ``text`` a text part (an empty one too), ``image`` an ``image_url`` part (a ``base64`` source as
  a ``data:`` URL, its ``media_type`` defaulting to ``image/png``; a ``url`` source as that URL),
  ``tool_use`` one of the turn's ``tool_calls`` (its ``id``, ``name``, and ``input`` as
  ``json.dumps`` writes it). A ``tool_result`` in a user's turn becomes a ``tool`` message
  (``tool_call_id`` = ``tool_use_id``), the user's parts before it a user message of their own
  ahead of it (user before -> tool -> user after); in another role's turn, the text part
  ``Tool result: ...``. A result's content: a string, or its parts (one text part alone as a
  string; none: ``""``). An assistant's ``thinking`` blocks become its ``reasoning_content``
  (joined by newlines); ``redacted_thinking`` is refused (nothing a local model can read).
  Other blocks are not part of the chat request. One text part alone is sent as a string; an
  assistant turn left with nothing is an empty one (``""``), a user's is left out.
- ``thinking``: anything but ``disabled`` turns the chat template's thinking on.
- ``tools``: each custom tool a function (``name``, ``description`` or ``""``, ``input_schema``
  as its ``parameters``); Anthropic's server tools (a ``type`` and no ``input_schema``) are
  skipped. ``tool_choice``: ``none`` -> ``none``; with tools ``auto`` -> ``auto``, ``any`` ->
  ``required``, ``tool`` -> that function (one not among them is refused); ``any``/``tool``
  without a tool to call is refused; tools without a ``tool_choice`` -> ``auto``.

A body that is not such a request raises ``RequestError`` (a 400 in Anthropic's error shape).
"""

from __future__ import annotations

import json
from typing import Any

from app.emulator.genrequest import RequestError

ROLES = ("user", "assistant", "system")


def to_chat(body: Any) -> dict[str, Any]:
    """The chat-completions body ``body`` (a Messages or count_tokens request) stands for."""
    if not isinstance(body, dict):
        raise RequestError("The request body must be a JSON object.")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise RequestError("model: Field required")
    raw_messages = body.get("messages")
    if not isinstance(raw_messages, list):
        raise RequestError("messages: Field required")
    messages: list[dict[str, Any]] = []
    system = _system_text(body.get("system"))
    if system:
        messages.append({"role": "system", "content": system})
    for index, message in enumerate(raw_messages):
        messages.extend(_turn(message, index))
    chat: dict[str, Any] = {"model": model, "messages": messages}
    thinking = body.get("thinking")
    if isinstance(thinking, dict):
        enabled = thinking.get("type") != "disabled"
        chat["chat_template_kwargs"] = {"thinking": enabled}
    tools = _tools(body.get("tools"))
    if tools:
        chat["tools"] = tools
    choice = _tool_choice(body.get("tool_choice"), tools)
    if choice is not None:
        chat["tool_choice"] = choice
    return chat


def _system_text(system: Any) -> str:
    if system is None:
        return ""
    if isinstance(system, str):
        return system if system.strip() else ""
    if not isinstance(system, list):
        raise RequestError("system: must be a string or a list of text blocks")
    texts = []
    for block in system:
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            raise RequestError("system: each block must be an object with a type")
        if block["type"] == "text" and block.get("text"):
            texts.append(str(block["text"]))
    return "\n".join(texts)


def _turn(message: Any, index: int) -> list[dict[str, Any]]:
    """The chat messages one Messages turn becomes (tool results first, then the turn)."""
    where = f"messages.{index}"
    if not isinstance(message, dict):
        raise RequestError(f"{where}: must be an object")
    role = message.get("role")
    if role not in ROLES:
        raise RequestError(f"{where}.role: must be one of 'user', 'assistant', 'system'")
    content = message.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise RequestError(f"{where}.content: must be a string or a list of blocks")
    out: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    turn: dict[str, Any] = {"role": role}
    for number, block in enumerate(content):
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            raise RequestError(f"{where}.content.{number}: must be an object with a type")
    if role == "assistant":
        if any(block["type"] == "redacted_thinking" for block in content):
            raise RequestError("Anthropic redacted_thinking history is not supported")
        thoughts = [
            str(b["thinking"]) for b in content if b["type"] == "thinking" and b.get("thinking")
        ]
        if thoughts:
            turn["reasoning_content"] = "\n".join(thoughts)
    for block in content:
        kind = block["type"]
        if kind == "text" and block.get("text") is not None:
            parts.append({"type": "text", "text": str(block["text"])})
        elif kind == "image":
            image = _image(block.get("source"))
            if image is not None:
                parts.append(image)
        elif kind == "tool_use":
            arguments = json.dumps(block.get("input") or {})
            function = {"name": str(block.get("name") or ""), "arguments": arguments}
            call_id = str(block.get("id") or "")
            calls.append({"id": call_id, "type": "function", "function": function})
        elif kind == "tool_result":
            result, text = _result(block.get("content"))
            if role == "user":
                if parts:  # what the user wrote before the result comes before it
                    out.append({"role": "user", "content": _single(parts)})
                    parts = []
                call_id = str(block.get("tool_use_id") or block.get("id") or "")
                out.append({"role": "tool", "tool_call_id": call_id, "content": result})
            else:
                parts.append({"type": "text", "text": f"Tool result: {text}"})
    if calls:
        turn["tool_calls"] = calls
    if parts:
        turn["content"] = _single(parts)
    elif not calls:
        if role == "user":
            return out
        turn["content"] = ""
    out.append(turn)
    return out


def _single(parts: list[dict[str, Any]]) -> str | list[dict[str, Any]]:
    """One text part alone as its string; else the parts."""
    if len(parts) == 1 and parts[0]["type"] == "text":
        return str(parts[0]["text"])
    return parts


def _image(source: Any) -> dict[str, Any] | None:
    if not isinstance(source, dict):
        return None
    if source.get("type") == "base64":
        data = source.get("data")
        if not data:
            return None
        media = source.get("media_type") or "image/png"
        return {"type": "image_url", "image_url": {"url": f"data:{media};base64,{data}"}}
    url = source.get("url")
    return {"type": "image_url", "image_url": {"url": str(url)}} if url else None


def _result(content: Any) -> tuple[str | list[dict[str, Any]], str]:
    """A tool result's content as the tool message's, and as text."""
    if not isinstance(content, list):
        text = str(content) if content else ""
        return text, text
    parts: list[dict[str, Any]] = []
    texts: list[str] = []
    for item in content:
        if not isinstance(item, dict):
            continue
        if item.get("type") == "text" and item.get("text"):
            texts.append(str(item["text"]))
            parts.append({"type": "text", "text": str(item["text"])})
        elif item.get("type") == "image":
            image = _image(item.get("source"))
            if image is not None:
                parts.append(image)
    return (_single(parts) if parts else ""), "\n".join(texts)


def _tools(raw: Any) -> list[dict[str, Any]]:
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise RequestError("tools: must be a list")
    tools = []
    for number, tool in enumerate(raw):
        if not isinstance(tool, dict) or not isinstance(tool.get("name"), str):
            raise RequestError(f"tools.{number}: must be an object with a name")
        if tool.get("type") not in (None, "custom") and "input_schema" not in tool:
            continue  # an Anthropic server tool: nothing the model can call here
        function = {
            "name": tool["name"],
            "description": str(tool.get("description") or ""),
            "parameters": tool.get("input_schema"),
        }
        tools.append({"type": "function", "function": function})
    return tools


def _tool_choice(raw: Any, tools: list[dict[str, Any]]) -> str | dict[str, Any] | None:
    if raw is None:
        return "auto" if tools else None
    kind = raw.get("type") if isinstance(raw, dict) else None
    if kind not in ("auto", "any", "tool", "none"):
        raise RequestError("tool_choice.type: must be one of 'auto', 'any', 'tool', 'none'")
    if kind == "none":
        return "none"
    if not tools:
        if kind in ("any", "tool"):
            raise RequestError(f"tool_choice={kind!r} requires at least one custom tool")
        return None
    if kind == "tool":
        name = raw.get("name")
        if name not in {tool["function"]["name"] for tool in tools}:
            raise RequestError(f"tool_choice references tool {name!r}, which is not in tools")
        return {"type": "function", "function": {"name": name}}
    return "auto" if kind == "auto" else "required"
