"""A Responses request as the worker's chat-completions body (once per request).

``input`` (a string: one user turn; or a list of items) becomes the chat ``messages``
(``items.py``), after a system message holding ``instructions`` and after the stored
conversation a ``previous_response_id`` continues (``store.py``):

- ``message`` items (``type`` may be left out): ``system`` and ``developer`` → a ``system``
  message in place, ``user`` and ``assistant`` as they are; content a string or parts:
  ``input_text``/``output_text`` → text, ``refusal`` → text, ``input_image`` with an
  ``image_url`` → an ``image_url`` part (a ``file_id`` is a 400: there is no Files API here),
  ``input_file`` → 400. One text part alone is sent as a string.
- ``function_call`` → the assistant's ``tool_calls`` (``call_id`` kept as the call's id; calls
  that follow an assistant message or each other join that one assistant turn);
  ``function_call_output`` → a ``tool`` message with ``tool_call_id`` = ``call_id`` (output a
  string, or text and image parts).
- ``reasoning`` → folded into the next assistant turn as its ``reasoning_content`` (its
  ``content`` texts, else its ``summary`` texts; ``encrypted_content`` is never produced by this
  gateway and is ignored): Kimi-K2.5's chat template then keeps or drops it as the model was
  trained (it keeps the thinking of the turns after the last user message).
- ``custom_tool_call`` → a call of the custom tool's function (its ``input`` as the one argument,
  ``app.responses.custom``), joined as ``function_call`` is; ``custom_tool_call_output`` → a
  ``tool`` message as ``function_call_output`` is.
- Any other item type (hosted tools' calls...) → 400 naming it
  (``item_reference`` items are resolved before: ``references.py``).

Other fields: ``tools`` (``tools.py``) -- ``function`` tools as chat functions (``strict`` kept),
``namespace`` tools (Codex groups some functions so) flattened to functions named
``namespace.name`` and named back on the way out; hosted tools (``web_search``,
``file_search``, ``code_interpreter``, ``computer_use_preview``, ``image_generation``, ``mcp``,
``local_shell``, ``shell``, ``apply_patch``...) are a 400 naming the type: nothing here runs
them, and a model offered a tool it cannot call answers differently; ``custom`` (free-form) tools
→ a function with one string argument (``app.responses.custom``: a grammar is advice, not
enforced). ``tool_choice`` (auto / none / required / a function or custom tool by name),
``parallel_tool_calls``, ``max_output_tokens`` → ``max_tokens``, ``temperature``, ``top_p``,
``text.format`` (``text``; ``json_object`` and ``json_schema`` → ``response_format``),
``reasoning.effort`` → Kimi-K2.5's thinking switch (``chat_template_kwargs.thinking``:
``none`` → off, any other effort → on, absent → the model's default, which is to think),
``reasoning.summary`` (set: the reasoning streams as a summary, else as reasoning text),
``user`` → ``user`` (the routing key; else ``prompt_cache_key`` is), ``stream`` (with usage
always on).

Refused with a 400 naming the field (they would change the answer and cannot be honoured):
``background: true``, ``conversation``, ``prompt``, ``max_tool_calls``, ``top_logprobs``,
``truncation: "auto"``, ``include: ["message.output_text.logprobs"]``, and ``previous_response_id``
when no store is configured. Accepted and ignored (they do not change the answer): ``metadata``
(echoed and stored; bounded as OpenAI bounds it, ``app.proxy.metadata``), ``store`` (a hint: kept
when a store is configured), ``include`` (other values), ``prompt_cache_key`` (a routing key),
``prompt_cache_retention``, ``safety_identifier``, ``service_tier``, ``stream_options``,
``text.verbosity``, ``client_metadata``,
``truncation: "disabled"``. Any other field is dropped (``Translated.dropped`` names the first;
counted like the chat route's).

Parse cost is bounded: a body whose JSON values would take more than about three times its size
as Python objects is refused before it is parsed (``load``), and nesting deeper than
``MAX_DEPTH`` is a 400.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson

from app.errors import InvalidRequest
from app.proxy.metadata import check_metadata
from app.responses.items import input_messages
from app.responses.names import Names
from app.responses.tools import echo_tools, tool_choice, tools

MAX_DEPTH = 64
# About what CPython takes per container, per string and per other value (a number: the object
# and its slot) decoded from JSON, in bytes; commas count the values.
_CONTAINER_COST, _STRING_COST, _VALUE_COST = 64, 56, 32
_SLACK = 1 << 20  # small bodies are never refused by the estimate
IGNORED = frozenset(
    {
        "metadata",
        "store",
        "include",
        "prompt_cache_key",
        "prompt_cache_retention",
        "safety_identifier",
        "service_tier",
        "stream_options",
        "client_metadata",
        "truncation",
    }
)
TRANSLATED = frozenset(
    {
        "model",
        "input",
        "instructions",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "max_output_tokens",
        "temperature",
        "top_p",
        "text",
        "reasoning",
        "user",
        "stream",
        "previous_response_id",
        "background",
        "conversation",
        "prompt",
        "max_tool_calls",
        "top_logprobs",
    }
)
_EFFORTS = Names({"minimal", "low", "medium", "high", "xhigh", "max"})
_SUMMARIES = Names({"auto", "concise", "detailed"})


@dataclass(slots=True)
class Translated:
    chat: dict[str, Any]  # the chat-completions body (without ``rid``)
    stream: bool
    # The request's settings as the Response object repeats them.
    echo: dict[str, Any] = field(default_factory=dict)
    # A flattened tool's chat name → (namespace, name).
    names: dict[str, tuple[str, str]] = field(default_factory=dict)
    summary: bool = False  # reasoning streams as a summary (else as reasoning text)
    store: bool = True
    previous: str | None = None
    # The chat messages after the instructions: what a stored response continues from.
    conversation: list[dict[str, Any]] = field(default_factory=list)
    dropped: str | None = None  # the first field of the body that was dropped, if any
    custom: frozenset[str] = frozenset()  # the chat names of the custom (free-form) tools


def _fail(message: str, param: str | None = None) -> InvalidRequest:
    return InvalidRequest(message, param=param)


def load(raw: bytes) -> dict[str, Any]:
    """The body as an object; a 400 for what is not one, for a body whose values would take far
    more memory than its size (many tiny values), and for nesting deeper than ``MAX_DEPTH``."""
    containers = raw.count(b"{") + raw.count(b"[")
    strings = raw.count(b'"') // 2
    values = raw.count(b",")
    cost = containers * _CONTAINER_COST + strings * _STRING_COST + values * _VALUE_COST
    if cost > 3 * len(raw) + _SLACK:
        raise _fail("request body holds too many JSON values for its size")
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise _fail("request body is not valid JSON (or is nested too deeply)") from None
    if not isinstance(body, dict):
        raise _fail("request body must be a JSON object")
    _check_depth(body)
    return body


def _check_depth(value: Any) -> None:
    """Iterative: a depth check must not itself recurse as deep as the value."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise _fail(f"request body is nested more than {MAX_DEPTH} levels deep")
        if isinstance(node, dict):
            stack.extend((child, depth + 1) for child in node.values() if _nests(child))
        elif isinstance(node, list):
            stack.extend((child, depth + 1) for child in node if _nests(child))


def _nests(value: Any) -> bool:
    return isinstance(value, dict | list)


def translate(
    body: dict[str, Any],
    *,
    max_messages: int,
    history: list[dict[str, Any]] | None = None,
) -> Translated:
    """The chat body for Responses request ``body`` (``history``: the stored conversation
    ``previous_response_id`` names); ``InvalidRequest`` (400) for what cannot be honoured."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _fail("model: a non-empty string is required", "model")
    _refuse_unsupported(body)
    names: dict[str, tuple[str, str]] = {}
    custom: set[str] = set()
    functions = tools(body.get("tools"), names, custom)
    conversation = list(history or ())
    input_messages(body.get("input"), conversation, has_history=bool(history))
    if len(conversation) + 1 > max_messages:
        raise _fail(f"input: at most {max_messages} messages in all", "input")
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise _fail("instructions: must be a string", "instructions")
        if instructions:
            messages.append({"role": "system", "content": instructions})
    messages += conversation
    chat: dict[str, Any] = {"model": model, "messages": messages}
    if functions:
        chat["tools"] = functions
    echo: dict[str, Any] = {}
    tool_choice(body.get("tool_choice"), functions, chat, echo, custom)
    _sampling(body, chat, echo)
    summary = _reasoning(body.get("reasoning"), chat, echo)
    _text(body.get("text"), chat, echo)
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise _fail("stream: must be a boolean", "stream")
    if stream:
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True}
    store = body.get("store")
    if store is not None and not isinstance(store, bool):
        raise _fail("store: must be a boolean", "store")
    metadata = body.get("metadata")
    check_metadata(metadata)
    echo.update(
        instructions=instructions if isinstance(instructions, str) else None,
        metadata=metadata or {},
        tools=echo_tools(body.get("tools")),
        previous_response_id=body.get("previous_response_id"),
        user=chat.get("user") if isinstance(body.get("user"), str) else None,
    )
    known = TRANSLATED | IGNORED
    dropped = next((name for name in body if name not in known), None)
    return Translated(
        chat,
        bool(stream),
        echo,
        names,
        summary,
        store is not False,
        body.get("previous_response_id"),
        conversation,
        dropped,
        frozenset(custom),
    )


def _refuse_unsupported(body: dict[str, Any]) -> None:
    if body.get("background"):
        raise _fail("background: background responses are not supported", "background")
    for name in ("conversation", "prompt", "max_tool_calls"):
        if body.get(name) is not None:
            raise _fail(f"{name}: not supported by this gateway", name)
    if body.get("top_logprobs"):
        raise _fail("top_logprobs: log-probabilities are not supported here", "top_logprobs")
    truncation = body.get("truncation")
    if truncation not in (None, "disabled"):
        raise _fail('truncation: only "disabled" is supported', "truncation")
    include = body.get("include")
    if include is not None:
        if not isinstance(include, list) or not all(isinstance(i, str) for i in include):
            raise _fail("include: must be an array of strings", "include")
        if "message.output_text.logprobs" in include:
            raise _fail("include: log-probabilities are not supported here", "include")
    previous = body.get("previous_response_id")
    if previous is not None and (not isinstance(previous, str) or not previous):
        raise _fail("previous_response_id: must be a non-empty string", "previous_response_id")


def _number(body: dict[str, Any], name: str) -> Any:
    value = body.get(name)
    if value is not None and (not isinstance(value, int | float) or isinstance(value, bool)):
        raise _fail(f"{name}: must be a number", name)
    return value


def _sampling(body: dict[str, Any], chat: dict[str, Any], echo: dict[str, Any]) -> None:
    for name in ("temperature", "top_p"):
        value = _number(body, name)
        echo[name] = value
        if value is not None:
            chat[name] = value
    tokens = body.get("max_output_tokens")
    if tokens is not None:
        if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 1:
            raise _fail("max_output_tokens: must be a positive integer", "max_output_tokens")
        chat["max_tokens"] = tokens
    echo["max_output_tokens"] = tokens
    parallel = body.get("parallel_tool_calls")
    if parallel is not None:
        if not isinstance(parallel, bool):
            raise _fail("parallel_tool_calls: must be a boolean", "parallel_tool_calls")
        if "tools" in chat:
            chat["parallel_tool_calls"] = parallel
    echo["parallel_tool_calls"] = parallel is not False
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise _fail("user: must be a string", "user")
    key = body.get("prompt_cache_key")
    routing = user if user else key if isinstance(key, str) and key else None
    if routing is not None:
        chat["user"] = routing


def _reasoning(value: Any, chat: dict[str, Any], echo: dict[str, Any]) -> bool:
    """Sets the thinking switch; True when the reasoning is to stream as a summary."""
    echo["reasoning"] = None
    if value is None:
        return False
    if not isinstance(value, dict):
        raise _fail("reasoning: must be an object", "reasoning")
    effort = value.get("effort")
    if effort == "none":
        chat["chat_template_kwargs"] = {"thinking": False}
    elif effort in _EFFORTS:
        chat["chat_template_kwargs"] = {"thinking": True}
    elif effort is not None:
        raise _fail("reasoning.effort: must be none, minimal, low, medium or high", "reasoning")
    summary = value.get("summary", value.get("generate_summary"))
    if summary is not None and summary not in _SUMMARIES and summary != "none":
        raise _fail("reasoning.summary: must be auto, concise or detailed", "reasoning")
    wants = summary in _SUMMARIES
    echo["reasoning"] = {"effort": effort, "summary": summary if wants else None}
    return wants


def _text(value: Any, chat: dict[str, Any], echo: dict[str, Any]) -> None:
    echo["text"] = {"format": {"type": "text"}}
    if value is None:
        return
    if not isinstance(value, dict):
        raise _fail("text: must be an object", "text")
    fmt = value.get("format")
    if fmt is None:
        return
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return
    if kind == "json_object":
        chat["response_format"] = {"type": "json_object"}
    elif kind == "json_schema" and isinstance(fmt, dict):
        name, schema = fmt.get("name"), fmt.get("schema")
        if not isinstance(name, str) or not name:
            raise _fail("text.format.name: a non-empty string is required", "text")
        if not isinstance(schema, dict):
            raise _fail("text.format.schema: an object (a JSON schema) is required", "text")
        spec: dict[str, Any] = {"name": name, "schema": schema}
        if isinstance(fmt.get("strict"), bool):
            spec["strict"] = fmt["strict"]
        if isinstance(fmt.get("description"), str):
            spec["description"] = fmt["description"]
        chat["response_format"] = {"type": "json_schema", "json_schema": spec}
    else:
        raise _fail("text.format.type: must be text, json_object or json_schema", "text")
    echo["text"] = {"format": fmt}
