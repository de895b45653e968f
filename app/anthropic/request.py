"""A Messages request as the worker's chat-completions body (once per request).

The messages come out as SGLang's own Messages endpoint builds them (so the worker's
``count_tokens``, which uses that converter, counts the prompt this request sends, and a
conversation's turns render the same bytes every time, which the workers' prefix cache needs):
``system`` (a string or text blocks, joined by newlines) → a system message; a ``system``-role
entry inside ``messages`` (Claude Code sends its environment block as one, after the user's turn)
→ a system message at that same position (text blocks only, as parts). SGLang's converter keeps
such entries in place whenever the chat template renders system turns anywhere, as Kimi-K2.5's
does (it merges them into the leading system prompt only for templates that cannot): so the
model reads the context where the client put it, ``count_tokens`` agrees, and a block that
changes from request to request (dates, git status) does not change the prompt's leading bytes,
which would cost the whole conversation its prefix-cache hit. Each turn's blocks
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
``thinking.display: "omitted"`` keeps the answer's thinking blocks empty (``omit_thinking``); any
other display (``summarized``, Claude Code's ``updates``...) gets the whole thinking text.
``output_format`` / ``output_config.format`` (``json_schema``) → ``response_format``
(``json_schema``, the worker's constrained decoding); ``output_config.effort`` is accepted and not
enforced (Kimi-K2.5's only switch is thinking on or off, which ``thinking`` sets).
``context_management``: ``clear_thinking_20251015`` edits are applied (the thinking of all but the
last ``keep`` assistant turns with thinking is left out; ``keep: "all"`` keeps it all), any other
edit is a 400 naming it (Claude Code then stops sending it: its message says the strategy is not
supported). Anything else is dropped (``Translated.dropped`` names the first), ``cache_control``
markers included (the workers cache prefixes by themselves), and so is ``defer_loading`` on a
tool: every tool the client sent is offered to the model.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import msgspec
import orjson

from app.errors import InvalidRequest
from app.media_policy import DEFAULT_POLICY, ImagePolicy
from app.proxy.media import check_image_url
from app.proxy.metadata import check_metadata

# The fields translated (the rest are dropped); count_tokens reads the first six.
COUNTED = ("model", "messages", "system", "tools", "tool_choice", "thinking")
FIELDS = frozenset(
    {*COUNTED, "max_tokens", "metadata", "stop_sequences", "stream", "temperature", "top_p"}
    | {"top_k", "context_management", "output_config", "output_format"}
)
CLEAR_THINKING = "clear_thinking_20251015"


@dataclass(slots=True)
class Translated:
    chat: dict[str, Any]  # the chat-completions body (without ``rid``)
    stream: bool
    dropped: str | None = None  # the first field of the body that was dropped, if any
    omit_thinking: bool = False  # ``thinking.display: "omitted"``: thinking blocks left empty


def _fail(message: str, param: str | None = None) -> InvalidRequest:
    return InvalidRequest(message, param=param)


# What a body may cost once decoded: 3x its size, plus a little for small bodies of any shape.
SIZE_FACTOR = 3
SIZE_SLACK = 4 * 1024 * 1024
# How deep a body's values may nest (objects and arrays, the body itself included): far more than
# any conversation or tool schema needs, and within what the chat body's encoder takes (254).
MAX_DEPTH = 64
# Digits as "0", anything else as " ": a run of 19 "0"s is a number past 64 bits (or digits in
# a string), found at C speed (a regular expression takes 5 times as long).
_DIGITS = bytes(0x30 if 0x30 <= i <= 0x39 else 0x20 for i in range(256))
_BIG_INT = b"0" * 19


def load(raw: bytes) -> dict[str, Any]:
    """The body as Python objects, bounded before they exist: what decoding would cost is
    estimated from the bytes that make containers, strings and separators (an upper bound, from
    ``bytes.count``), and a body that would cost more than ``SIZE_FACTOR`` times its size (plus
    ``SIZE_SLACK``) is refused. Decoded by msgspec (no transient buffers; orjson, which reads a
    number past 64 bits as a float as the chat body's encoder needs, when the bytes hold a run
    of 19 digits). Then no value may nest deeper than ``MAX_DEPTH`` (the 400 names where)."""
    if len(raw) > SIZE_SLACK // 100 and _decoded_size(raw) > SIZE_FACTOR * len(raw) + SIZE_SLACK:
        raise _fail(
            "request body holds too many JSON values for its size (objects, arrays, strings "
            f"or numbers); at most {SIZE_FACTOR} times its size once decoded"
        )
    try:
        if _has_big_int(raw):
            body = orjson.loads(raw)
        else:
            try:
                body = msgspec.json.decode(raw)
            except RecursionError:  # orjson reads deeper (1024 levels): the 400 can say where
                body = orjson.loads(raw)
    except (orjson.JSONDecodeError, msgspec.DecodeError):
        raise _fail("request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise _fail("request body must be a JSON object")
    where = _too_deep(body, MAX_DEPTH)
    if where is not None:
        raise _fail(f"{where}: nests more than {MAX_DEPTH} levels deep", where)
    return body


def _has_big_int(raw: bytes, window: int = 1 << 16) -> bool:
    """Whether ``raw`` holds a run of 19 digits, read in windows (no copy of a large body)."""
    view = memoryview(raw)
    step = window - len(_BIG_INT)
    return any(
        _BIG_INT in bytes(view[at : at + window]).translate(_DIGITS)
        for at in range(0, max(len(raw) - len(_BIG_INT), 0) + 1, step)
    )


def _decoded_size(raw: bytes) -> int:
    """An upper bound on the bytes ``raw`` takes as Python objects (measured on CPython 3.11:
    about 70-190 bytes per object or array, 55 per string, 8-32 per element, and the text)."""
    containers = raw.count(b"{") + raw.count(b"[")
    quotes = raw.count(b'"')  # two per string (escaped ones count too: an over-estimate)
    separators = raw.count(b",") + raw.count(b":")
    return len(raw) + 100 * containers + 28 * quotes + 16 * separators


def _too_deep(body: dict[str, Any], limit: int) -> str | None:
    """Where (``field.0.key``, up to 5 steps) a value first nests past ``limit`` levels; None
    when none does. Depth first, one iterator per level: what the walk holds is bounded by the
    depth, not by the body's size."""
    stack: list[Iterator[tuple[Any, Any]]] = [iter(body.items())]
    keys: list[Any] = []  # the path to the container whose iterator is on top
    while stack:
        for key, item in stack[-1]:
            if isinstance(item, dict | list):
                if len(stack) + 1 > limit:
                    return ".".join(map(str, [*keys, key][:5]))
                keys.append(key)
                stack.append(iter(item.items()) if isinstance(item, dict) else enumerate(item))
                break
        else:
            stack.pop()
            if keys:
                keys.pop()
    return None


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
    _context_management(body.get("context_management"), out)
    chat["messages"] = out
    if not count_only:
        max_tokens = body.get("max_tokens")
        if not _positive_int(max_tokens):
            raise _fail("max_tokens: a positive integer is required", "max_tokens")
        chat["max_tokens"] = max_tokens
        _sampling(body, chat)
        _output(body, chat)
    _tools(body, chat)
    omit = _thinking(body.get("thinking"), chat)
    stream = body.get("stream", False)
    if stream is not None and not isinstance(stream, bool):
        raise _fail("stream: must be a boolean", "stream")
    if stream and not count_only:
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True}
    known = frozenset(COUNTED) if count_only else FIELDS
    dropped = next((name for name in body if name not in known), None)
    return Translated(chat, bool(stream) and not count_only, dropped, omit)


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
    check_metadata(metadata, nulls=True)
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
        if not isinstance(name, str):
            raise _fail("tool_choice.name: a string is required", "tool_choice.name")
        if name not in {f["function"]["name"] for f in functions}:
            raise _fail(f"tool_choice.name: no tool named {name[:100]!r}", "tool_choice.name")
        chat["tool_choice"] = {"type": "function", "function": {"name": name}}
    else:
        chat["tool_choice"] = "required" if kind == "any" else "auto"
    if choice.get("disable_parallel_tool_use") is True:
        chat["parallel_tool_calls"] = False


_THINKING_TYPES = ("enabled", "disabled", "adaptive")


def _thinking(thinking: Any, chat: dict[str, Any]) -> bool:
    """Sets Kimi's thinking switch; True when the client asked for the thinking to be omitted."""
    if thinking is None:
        return False
    if not isinstance(thinking, dict) or thinking.get("type") not in _THINKING_TYPES:
        raise _fail("thinking.type: must be enabled, disabled or adaptive", "thinking")
    kind, display = thinking["type"], thinking.get("display")
    if display is not None and not isinstance(display, str):
        raise _fail("thinking.display: must be a string", "thinking")
    chat["chat_template_kwargs"] = {"thinking": kind != "disabled"}
    return display == "omitted"


def _output(body: dict[str, Any], chat: dict[str, Any]) -> None:
    """``output_config`` (``effort``: accepted; ``format``) and the older ``output_format``."""
    config = body.get("output_config")
    if config is not None and not isinstance(config, dict):
        raise _fail("output_config: must be an object", "output_config")
    config = config or {}
    effort = config.get("effort")
    if effort is not None and not isinstance(effort, str):
        raise _fail("output_config.effort: must be a string", "output_config")
    unknown = next((name for name in config if name not in ("effort", "format")), None)
    if unknown is not None:
        raise _fail(f"output_config.{unknown}: not supported by this gateway", "output_config")
    fmt = config.get("format", body.get("output_format"))
    if fmt is None:
        return
    where = "output_config" if "format" in config else "output_format"
    kind, schema = (fmt.get("type"), fmt.get("schema")) if isinstance(fmt, dict) else (None, None)
    if kind != "json_schema" or not isinstance(schema, dict):
        raise _fail(f"{where}: a json_schema format with an object schema is required", where)
    chat["response_format"] = {
        "type": "json_schema",
        "json_schema": {"name": "output", "schema": schema, "strict": True},
    }


def _context_management(value: Any, out: list[dict[str, Any]]) -> None:
    """Applies ``clear_thinking`` edits to the translated history; refuses any other edit."""
    if value is None:
        return
    edits = value.get("edits") if isinstance(value, dict) else None
    if not isinstance(edits, list):
        raise _fail("context_management.edits: must be an array", "context_management")
    for i, edit in enumerate(edits):
        if not isinstance(edit, dict) or edit.get("type") != CLEAR_THINKING:
            kind = edit.get("type") if isinstance(edit, dict) else None
            raise _fail(
                f"context_management.edits.{i}: this gateway does not support the {kind} "
                "context management strategy",
                "context_management",
            )
        keep = edit.get("keep", {"type": "thinking_turns", "value": 1})
        if keep == "all":
            continue
        turns = keep.get("value") if isinstance(keep, dict) else None
        if not (isinstance(turns, int) and not isinstance(turns, bool) and turns >= 0) or (
            isinstance(keep, dict) and keep.get("type") != "thinking_turns"
        ):
            raise _fail(
                f'context_management.edits.{i}.keep: "all" or thinking_turns is required',
                "context_management",
            )
        thinking = [m for m in out if m["role"] == "assistant" and "reasoning_content" in m]
        for message in thinking[: max(len(thinking) - turns, 0)]:
            del message["reasoning_content"]
