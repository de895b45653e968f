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

from dataclasses import dataclass
from typing import Any

from app.anthropic.body import MAX_DEPTH, SIZE_FACTOR, SIZE_SLACK, load
from app.anthropic.options import context_management, output, sampling, thinking
from app.anthropic.options import tools as translate_tools
from app.anthropic.turns import system_text, turn
from app.errors import InvalidRequest
from app.media_policy import DEFAULT_POLICY, ImagePolicy

# ``load`` (the body, bounded) and its limits are the request's too.
__all__ = ["COUNTED", "MAX_DEPTH", "SIZE_FACTOR", "SIZE_SLACK", "Translated", "load", "translate"]

# The fields translated (the rest are dropped); count_tokens reads the first six.
COUNTED = ("model", "messages", "system", "tools", "tool_choice", "thinking")
FIELDS = frozenset(
    {*COUNTED, "max_tokens", "metadata", "stop_sequences", "stream", "temperature", "top_p"}
    | {"top_k", "context_management", "output_config", "output_format"}
)


@dataclass(slots=True)
class Translated:
    chat: dict[str, Any]  # the chat-completions body (without ``rid``)
    stream: bool
    dropped: str | None = None  # the first field of the body that was dropped, if any
    omit_thinking: bool = False  # ``thinking.display: "omitted"``: thinking blocks left empty


def _fail(message: str, param: str | None = None) -> InvalidRequest:
    return InvalidRequest(message, param=param)


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
    system = system_text(body.get("system") or "")
    if system:
        out.append({"role": "system", "content": system})
    for i, message in enumerate(messages):
        turn(message, i, out, images)
    context_management(body.get("context_management"), out)
    chat["messages"] = out
    if not count_only:
        max_tokens = body.get("max_tokens")
        if not _positive_int(max_tokens):
            raise _fail("max_tokens: a positive integer is required", "max_tokens")
        chat["max_tokens"] = max_tokens
        sampling(body, chat)
        output(body, chat)
    translate_tools(body, chat)
    omit = thinking(body.get("thinking"), chat)
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
