"""A Messages request's turns as the worker's chat messages (see ``app.anthropic.request``).

``system`` and ``system``-role turns → system messages where they stand; each turn's blocks →
content parts (one text part alone is a string), ``tool_use`` → the assistant's ``tool_calls``,
``tool_result`` → a ``tool`` message between the user's parts before and after it, ``thinking``
→ ``reasoning_content``. Any block a turn may not hold is a 400 naming where.
"""

from __future__ import annotations

import json
from typing import Any

from app.errors import InvalidRequest
from app.media_policy import ImagePolicy
from app.proxy.media import check_image_url


def _fail(message: str, param: str | None = None) -> InvalidRequest:
    return InvalidRequest(message, param=param)


def system_text(system: Any) -> str:
    if isinstance(system, str):
        return system if system.strip() else ""
    if isinstance(system, list):
        texts = []
        for block in system:
            if not isinstance(block, dict) or block.get("type") != "text":
                raise _fail("system: must be a string or an array of text blocks", "system")
            text = _text(block, "system")
            if text:
                texts.append(text)
        return "\n".join(texts)
    raise _fail("system: must be a string or an array of text blocks", "system")


def _text(block: dict[str, Any], where: str) -> str:
    text = block.get("text")
    if not isinstance(text, str):
        raise _fail(f"{where}: a text block needs a string `text`", where)
    return text


def _image(block: dict[str, Any], where: str, images: ImagePolicy) -> dict[str, Any]:
    source = block.get("source")
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64" and isinstance(source, dict):
        media, data = source.get("media_type"), source.get("data")
        if isinstance(media, str) and isinstance(data, str):
            return {"type": "image_url", "image_url": {"url": f"data:{media};base64,{data}"}}
    elif kind == "url" and isinstance(source, dict) and isinstance(source.get("url"), str):
        check_image_url(source["url"], images, f"{where}.source.url")
        return {"type": "image_url", "image_url": {"url": source["url"]}}
    raise _fail(f"{where}: an image needs a base64 or url source", where)


def turn(message: Any, i: int, out: list[dict[str, Any]], images: ImagePolicy) -> None:
    where = f"messages.{i}"
    if not isinstance(message, dict):
        raise _fail(f"{where}: must be an object", where)
    role = message.get("role")
    if role not in ("user", "assistant", "system"):
        raise _fail(f"{where}.role: must be user, assistant or system", f"{where}.role")
    content = message.get("content")
    if isinstance(content, str):
        if role != "system" or content.strip():
            out.append({"role": role, "content": content})
        return
    if not isinstance(content, list):
        raise _fail(f"{where}.content: must be a string or an array", f"{where}.content")
    if role == "assistant":
        out.append(_assistant(content, where))
    elif role == "system":
        _system_turn(content, where, out)
    else:
        _user(content, where, out, images)


def _system_turn(blocks: list[Any], where: str, out: list[dict[str, Any]]) -> None:
    """A ``system``-role entry of ``messages``: a system message where it stands."""
    parts: list[dict[str, Any]] = []
    for j, block in enumerate(blocks):
        at = f"{where}.content.{j}"
        if not isinstance(block, dict) or block.get("type") != "text":
            raise _fail(f"{at}.type: a system turn holds text blocks only", at)
        text = _text(block, at)
        if text:
            parts.append({"type": "text", "text": text})
    if parts:
        out.append({"role": "system", "content": _content(parts)})


def _content(parts: list[dict[str, Any]]) -> Any:
    """One text part alone as a string, else the parts."""
    return parts[0]["text"] if len(parts) == 1 and parts[0]["type"] == "text" else parts


def _assistant(blocks: list[Any], where: str) -> dict[str, Any]:
    parts: list[dict[str, Any]] = []
    thinking: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(blocks):
        at = f"{where}.content.{j}"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            parts.append({"type": "text", "text": _text(block, at)})
        elif kind == "thinking":
            if isinstance(block.get("thinking"), str) and block["thinking"]:
                thinking.append(block["thinking"])
        elif kind == "tool_use":
            call_id, name = block.get("id"), block.get("name")
            if not isinstance(call_id, str) or not isinstance(name, str):
                raise _fail(f"{at}: a tool_use block needs a string id and name", at)
            arguments = json.dumps(block.get("input") or {})
            function = {"name": name, "arguments": arguments}
            calls.append({"id": call_id, "type": "function", "function": function})
        elif kind != "redacted_thinking":
            raise _fail(f"{at}.type: {kind!r} is not accepted in an assistant turn", at)
    message: dict[str, Any] = {"role": "assistant"}
    if thinking:
        message["reasoning_content"] = "\n".join(thinking)
    if parts:
        message["content"] = _content(parts)
    elif not calls:
        message["content"] = ""  # an empty turn still keeps the roles alternating
    if calls:
        message["tool_calls"] = calls
    return message


def _user(blocks: list[Any], where: str, out: list[dict[str, Any]], images: ImagePolicy) -> None:
    parts: list[dict[str, Any]] = []
    for j, block in enumerate(blocks):
        at = f"{where}.content.{j}"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            parts.append({"type": "text", "text": _text(block, at)})
        elif kind == "image":
            parts.append(_image(block, at, images))
        elif kind == "tool_result":
            if parts:  # what came before the result goes before it
                out.append({"role": "user", "content": _content(parts)})
                parts = []
            out.append(_tool_result(block, at, images))
        elif kind == "document" and _is_text_document(block):
            parts.append({"type": "text", "text": block["source"]["data"]})
        else:
            raise _fail(f"{at}.type: {kind!r} is not accepted in a user turn", at)
    if parts:
        out.append({"role": "user", "content": _content(parts)})


def _is_text_document(block: dict[str, Any]) -> bool:
    source = block.get("source")
    return (
        isinstance(source, dict)
        and source.get("type") == "text"
        and isinstance(source.get("data"), str)
    )


def _tool_result(block: dict[str, Any], at: str, images: ImagePolicy) -> dict[str, Any]:
    """The ``tool`` message for a ``tool_result`` block (text, or text and image parts)."""
    call_id = block.get("tool_use_id")
    if not isinstance(call_id, str):
        raise _fail(f"{at}: a tool_result block needs a string tool_use_id", at)
    content = block.get("content")
    result: Any = ""
    if isinstance(content, str):
        result = content
    elif isinstance(content, list):
        parts: list[dict[str, Any]] = []
        for k, item in enumerate(content):
            kind = item.get("type") if isinstance(item, dict) else None
            if kind == "text":
                text = _text(item, f"{at}.content.{k}")
                if text:
                    parts.append({"type": "text", "text": text})
            elif kind == "image":
                parts.append(_image(item, f"{at}.content.{k}", images))
            else:
                raise _fail(f"{at}.content.{k}.type: {kind!r} is not accepted here", at)
        result = _content(parts) if parts else ""
    elif content is not None:
        raise _fail(f"{at}.content: must be a string or an array", at)
    return {"role": "tool", "tool_call_id": call_id, "content": result}
