"""A Messages request as the worker's chat-completions body (once per request).

The messages come out as SGLang's own Messages endpoint builds them (so the worker's
``count_tokens``, which uses that converter, counts the prompt this request sends, and a
conversation's turns render the same bytes every time, which the workers' prefix cache needs):
``system`` (a string or text blocks, joined by newlines) → a system message; each turn's blocks
→ ``text`` and ``image`` (base64 → a ``data:`` URL, or a URL) as content parts (one text part
alone is a string), ``tool_use`` → the assistant's ``tool_calls`` (ids kept, ``input`` as
``json.dumps`` writes it), ``tool_result`` → a ``tool`` message (``tool_call_id`` =
``tool_use_id``) between the user's parts before and after it, ``thinking`` → the assistant's
``reasoning_content`` (``redacted_thinking`` has nothing a local model can read and is
dropped); ``is_error`` on a tool result is not represented.

The other fields: ``tools`` (``input_schema`` → ``parameters``; Anthropic's server tools, which
have no schema, are skipped), ``tool_choice`` (auto / any → required / tool → that function /
none; ``disable_parallel_tool_use`` → ``parallel_tool_calls: false``), ``thinking``
(enabled/adaptive → ``chat_template_kwargs.thinking: true``, disabled → false; absent → the
model's default, which for Kimi-K2.5 is to think; ``budget_tokens`` is not enforced),
``max_tokens`` (required, as Anthropic requires it), ``stop_sequences`` → ``stop``,
``temperature``, ``top_p``, ``top_k``, ``metadata.user_id`` → ``user`` (the routing key that
keeps a session on its worker), ``stream`` (with usage always on: the last event reports it).
Anything else is dropped (``Translated.dropped`` names the first), ``cache_control`` markers
included (the workers cache prefixes by themselves).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import orjson

from app.errors import InvalidRequest
from app.proxy.media import DEFAULT_POLICY, ImagePolicy, check_image_url

# The fields translated (the rest are dropped); count_tokens reads the first six.
COUNTED = ("model", "messages", "system", "tools", "tool_choice", "thinking")
FIELDS = frozenset(
    {*COUNTED, "max_tokens", "metadata", "stop_sequences", "stream", "temperature", "top_p"}
    | {"top_k"}
)


@dataclass(slots=True)
class Translated:
    chat: dict[str, Any]  # the chat-completions body (without ``rid``)
    stream: bool
    dropped: str | None = None  # the first field of the body that was dropped, if any


def _fail(message: str, param: str | None = None) -> InvalidRequest:
    return InvalidRequest(message, param=param)


def load(raw: bytes) -> dict[str, Any]:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise _fail("request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise _fail("request body must be a JSON object")
    return body


def translate(
    body: dict[str, Any],
    *,
    max_messages: int,
    count_only: bool = False,
    images: ImagePolicy = DEFAULT_POLICY,
) -> Translated:
    """The chat body for Messages request ``body``; ``InvalidRequest`` (400) for a body
    Anthropic's API would refuse. ``count_only``: a count_tokens body (no ``max_tokens``).
    ``images``: the image URLs a ``url`` source may name (``app.proxy.media``)."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _fail("model: a non-empty string is required", "model")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _fail("messages: a non-empty array is required", "messages")
    if len(messages) > max_messages:
        raise _fail(f"messages: at most {max_messages} messages", "messages")
    chat: dict[str, Any] = {"model": model}
    out: list[dict[str, Any]] = []
    system = _system_text(body.get("system") or "")
    if system:
        out.append({"role": "system", "content": system})
    for i, message in enumerate(messages):
        _turn(message, i, out, images)
    chat["messages"] = out
    if not count_only:
        max_tokens = body.get("max_tokens")
        if not _positive_int(max_tokens):
            raise _fail("max_tokens: a positive integer is required", "max_tokens")
        chat["max_tokens"] = max_tokens
        _sampling(body, chat)
    _tools(body, chat)
    _thinking(body.get("thinking"), chat)
    stream = body.get("stream", False)
    if stream is not None and not isinstance(stream, bool):
        raise _fail("stream: must be a boolean", "stream")
    if stream and not count_only:
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True}
    known = frozenset(COUNTED) if count_only else FIELDS
    dropped = next((name for name in body if name not in known), None)
    return Translated(chat, bool(stream) and not count_only, dropped)


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _system_text(system: Any) -> str:
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


def _turn(message: Any, i: int, out: list[dict[str, Any]], images: ImagePolicy) -> None:
    where = f"messages.{i}"
    if not isinstance(message, dict):
        raise _fail(f"{where}: must be an object", where)
    role = message.get("role")
    if role not in ("user", "assistant"):
        raise _fail(f"{where}.role: must be user or assistant", f"{where}.role")
    content = message.get("content")
    if isinstance(content, str):
        out.append({"role": role, "content": content})
        return
    if not isinstance(content, list):
        raise _fail(f"{where}.content: must be a string or an array", f"{where}.content")
    if role == "assistant":
        out.append(_assistant(content, where))
    else:
        _user(content, where, out, images)


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


def _sampling(body: dict[str, Any], chat: dict[str, Any]) -> None:
    stops = body.get("stop_sequences")
    if stops is not None:
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise _fail("stop_sequences: must be an array of strings", "stop_sequences")
        if stops:
            chat["stop"] = stops
    for name in ("temperature", "top_p"):
        value = body.get(name)
        if value is None:
            continue
        if not isinstance(value, int | float) or isinstance(value, bool):
            raise _fail(f"{name}: must be a number", name)
        chat[name] = value
    top_k = body.get("top_k")
    if top_k is not None:
        if not isinstance(top_k, int) or isinstance(top_k, bool):
            raise _fail("top_k: must be an integer", "top_k")
        chat["top_k"] = top_k
    metadata = body.get("metadata")
    if isinstance(metadata, dict) and isinstance(metadata.get("user_id"), str):
        chat["user"] = metadata["user_id"]


def _tools(body: dict[str, Any], chat: dict[str, Any]) -> None:
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise _fail("tools: must be an array", "tools")
    functions: list[dict[str, Any]] = []
    for i, tool in enumerate(tools or ()):
        if not isinstance(tool, dict) or not isinstance(tool.get("name"), str):
            raise _fail(f"tools.{i}: a tool needs a string name", f"tools.{i}")
        schema = tool.get("input_schema")
        if schema is None and tool.get("type") not in (None, "custom"):
            continue  # a server tool (web search, bash...): Anthropic runs those, not the model
        if not isinstance(schema, dict):
            raise _fail(f"tools.{i}.input_schema: an object is required", f"tools.{i}")
        function: dict[str, Any] = {"name": tool["name"], "parameters": schema}
        if isinstance(tool.get("description"), str):
            function["description"] = tool["description"]
        functions.append({"type": "function", "function": function})
    if functions:
        chat["tools"] = functions
    choice = body.get("tool_choice")
    if choice is None:
        return
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind == "none":
        chat["tool_choice"] = "none"
        return
    if not isinstance(choice, dict) or kind not in ("auto", "any", "tool"):
        raise _fail("tool_choice.type: must be auto, any, tool or none", "tool_choice")
    if not functions:
        if kind == "auto":
            return
        raise _fail(f"tool_choice: {kind!r} needs at least one tool", "tool_choice")
    if kind == "tool":
        name = choice.get("name")
        if name not in {f["function"]["name"] for f in functions}:
            raise _fail(f"tool_choice.name: no tool named {name!r}", "tool_choice")
        chat["tool_choice"] = {"type": "function", "function": {"name": name}}
    else:
        chat["tool_choice"] = "required" if kind == "any" else "auto"
    if choice.get("disable_parallel_tool_use") is True:
        chat["parallel_tool_calls"] = False


def _thinking(thinking: Any, chat: dict[str, Any]) -> None:
    if thinking is None:
        return
    kind = thinking.get("type") if isinstance(thinking, dict) else None
    if kind not in ("enabled", "disabled", "adaptive"):
        raise _fail("thinking.type: must be enabled, disabled or adaptive", "thinking")
    chat["chat_template_kwargs"] = {"thinking": kind != "disabled"}
