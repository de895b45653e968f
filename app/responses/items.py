"""``input`` items as chat messages, in order (see ``app.responses.request`` for what each
becomes): messages with their parts, function calls (and custom tools' calls, as their functions'
calls) joined into the assistant turn they follow, their outputs as ``tool`` messages, reasoning
folded into the next assistant turn."""

from __future__ import annotations

from typing import Any

from app.errors import InvalidRequest
from app.responses.custom import arguments_of
from app.responses.names import Names
from app.responses.tools import flat

_TEXT_PARTS = Names({"input_text", "output_text"})


def _fail(message: str, param: str | None = None) -> InvalidRequest:
    return InvalidRequest(message, param=param)


def _text_of(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise _fail(f"{where}: a string is required", where)
    return value


def _content(parts: list[dict[str, Any]]) -> Any:
    """One text part alone as a string, else the parts."""
    return parts[0]["text"] if len(parts) == 1 and parts[0]["type"] == "text" else parts


def _image(part: dict[str, Any], where: str) -> dict[str, Any]:
    if part.get("file_id") is not None:
        raise _fail(f"{where}.file_id: files are not supported here; send an image_url", where)
    url = part.get("image_url")
    if not isinstance(url, str) or not url:
        raise _fail(f"{where}.image_url: a URL or data: URL is required", where)
    image: dict[str, Any] = {"url": url}
    if part.get("detail") in ("low", "high", "auto"):
        image["detail"] = part["detail"]
    return {"type": "image_url", "image_url": image}


def _parts(content: Any, where: str, *, images: bool) -> Any:
    """A message's (or a tool output's) content as chat content."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _fail(f"{where}: must be a string or an array of parts", where)
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        at = f"{where}.{j}"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in _TEXT_PARTS:
            parts.append({"type": "text", "text": _text_of(part.get("text"), f"{at}.text")})
        elif kind == "refusal":
            parts.append({"type": "text", "text": _text_of(part.get("refusal"), f"{at}.refusal")})
        elif kind == "input_image" and images:
            parts.append(_image(part, at))
        else:
            raise _fail(f"{at}.type: {str(kind)[:64]!r} is not supported here", at)
    return _content(parts) if parts else ""


class _Turns:
    """Builds the chat messages from input items in order."""

    def __init__(self, out: list[dict[str, Any]]) -> None:
        self.out = out
        self.reasoning: list[str] = []
        self.open: dict[str, Any] | None = None  # the assistant turn tool calls may join

    def add(self, message: dict[str, Any]) -> None:
        if message["role"] == "assistant":
            if self.reasoning:
                message["reasoning_content"] = "\n".join(self.reasoning)
                self.reasoning = []
            self.open = message
        else:
            self.open = None
        self.out.append(message)

    def call(self, call: dict[str, Any]) -> None:
        if self.open is None:
            self.add({"role": "assistant", "tool_calls": []})
        assert self.open is not None
        if self.reasoning:  # reasoning between the turn's text and its calls: the same turn
            before = self.open.get("reasoning_content")
            texts = [before, *self.reasoning] if before else self.reasoning
            self.open["reasoning_content"] = "\n".join(texts)
            self.reasoning = []
        self.open.setdefault("tool_calls", []).append(call)


def input_messages(value: Any, out: list[dict[str, Any]], *, has_history: bool) -> None:
    """Append ``input``'s messages to ``out`` (which holds the stored conversation, if any)."""
    if isinstance(value, str):
        out.append({"role": "user", "content": value})
        return
    if value is None and has_history:
        return
    if not isinstance(value, list) or (not value and not has_history):
        raise _fail("input: a string or a non-empty array of items is required", "input")
    turns = _Turns(out)
    for i, item in enumerate(value):
        where = f"input.{i}"
        if not isinstance(item, dict):
            raise _fail(f"{where}: must be an object", where)
        kind = item.get("type", "message")
        if kind == "message":
            _message(item, where, turns)
        elif kind == "function_call":
            call_id = item.get("call_id")
            if not isinstance(call_id, str) or not call_id:
                raise _fail(f"{where}.call_id: a non-empty string is required", where)
            name = flat(item.get("name"), item.get("namespace"), where)
            arguments = item.get("arguments")
            if not isinstance(arguments, str):
                raise _fail(f"{where}.arguments: a JSON string is required", where)
            function = {"name": name, "arguments": arguments}
            turns.call({"id": call_id, "type": "function", "function": function})
        elif kind == "custom_tool_call":
            call_id = _call_id(item, where)
            name = flat(item.get("name"), None, where)
            text = item.get("input")
            if not isinstance(text, str):
                raise _fail(f"{where}.input: a string is required", where)
            function = {"name": name, "arguments": arguments_of(text)}
            turns.call({"id": call_id, "type": "function", "function": function})
        elif kind in ("function_call_output", "custom_tool_call_output"):
            call_id = item.get("call_id")
            if not isinstance(call_id, str) or not call_id:
                raise _fail(f"{where}.call_id: a non-empty string is required", where)
            output = _parts(item.get("output"), f"{where}.output", images=True)
            turns.add({"role": "tool", "tool_call_id": call_id, "content": output})
        elif kind == "reasoning":
            turns.reasoning += _reasoning_texts(item, where)
        else:
            raise _fail(f"{where}.type: {str(kind)[:64]!r} items are not supported here", where)


def _call_id(item: dict[str, Any], where: str) -> str:
    call_id = item.get("call_id")
    if not isinstance(call_id, str) or not call_id:
        raise _fail(f"{where}.call_id: a non-empty string is required", where)
    return call_id


def _message(item: dict[str, Any], where: str, turns: _Turns) -> None:
    role = item.get("role")
    if role not in ("user", "assistant", "system", "developer"):
        raise _fail(f"{where}.role: must be user, assistant, system or developer", where)
    content = _parts(item.get("content"), f"{where}.content", images=role == "user")
    if role == "developer":
        role = "system"
    turns.add({"role": role, "content": content})


def _reasoning_texts(item: dict[str, Any], where: str) -> list[str]:
    texts: list[str] = []
    for name in ("content", "summary"):
        parts = item.get(name)
        if parts is None:
            continue
        if not isinstance(parts, list):
            raise _fail(f"{where}.{name}: must be an array", where)
        for part in parts:
            text = part.get("text") if isinstance(part, dict) else None
            if not isinstance(text, str):
                raise _fail(f"{where}.{name}: every part needs a string text", where)
            if text:
                texts.append(text)
        if texts:
            return texts
    return texts
