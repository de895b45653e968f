"""The request fields the emulated worker reads, validated the way SGLang answers (400 bodies).

Bodies are read as plain JSON (no pydantic on the hot path). Rules that differ from a real worker
are documented here: an unset ``temperature`` counts as greedy (0) for the acceptance model; ``n``
other than 1 is rejected; grammar-constrained output (``response_format`` json_schema/regex/
structural_tag, or ``regex``/``json_schema``/``ebnf`` fields) is rejected as under DFLASH.
Prompt tokens are estimated as one token per 4 characters of the rendered prompt.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

CHARS_PER_TOKEN = 4
# SGLang echoes the request's ``model``; a request without one is answered as "default".
UNNAMED_MODEL = "default"


class RequestError(Exception):
    """Rendered as SGLang's ``ErrorResponse`` with this HTTP status."""

    def __init__(self, message: str, *, status: int = 400, err_type: str = "BadRequestError"):
        super().__init__(message)
        self.message = message
        self.status = status
        self.err_type = err_type


@dataclass(frozen=True)
class Tool:
    name: str
    parameters: dict[str, Any]


@dataclass
class GenRequest:
    kind: Literal["chat", "completion"]
    model: str
    prompt: str
    last_user: str
    rid: str | None = None
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False
    max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    temperature: float = 0.0
    seed: int | None = None
    thinking: bool = False
    tools: tuple[Tool, ...] = ()
    tool_choice: Any = None
    history_tool_calls: int = 0
    after_tool_result: bool = False  # the conversation ends with a tool's result
    return_meta_info: bool = False
    ignore_eos: bool = False

    @property
    def prompt_tokens(self) -> int:
        return max(1, -(-len(self.prompt) // CHARS_PER_TOKEN))


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = [p.get("text", "") for p in content if isinstance(p, dict)]
        return "".join(str(p) for p in parts)
    return ""


def _common(body: dict[str, Any]) -> dict[str, Any]:
    n = body.get("n", 1)
    if n != 1:
        raise RequestError(f"n={n} is not supported by this worker; only n=1 is served.")
    if "regex" in body or "json_schema" in body or "ebnf" in body:
        raise RequestError(_GRAMMAR_MESSAGE)
    fmt = body.get("response_format")
    if isinstance(fmt, dict) and fmt.get("type") in ("json_schema", "regex", "structural_tag"):
        raise RequestError(_GRAMMAR_MESSAGE)
    max_tokens = body.get("max_completion_tokens")
    if max_tokens is None:
        max_tokens = body.get("max_tokens")
    if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 0):
        raise RequestError("max_tokens must be a non-negative integer.")
    stop = body.get("stop")
    stops: tuple[str, ...] = ()
    if isinstance(stop, str):
        stops = (stop,) if stop else ()
    elif isinstance(stop, list):
        stops = tuple(s for s in stop if isinstance(s, str) and s)
    temperature = body.get("temperature")
    if temperature is not None and not isinstance(temperature, int | float):
        raise RequestError("temperature must be a number.")
    seed = body.get("seed")
    rid = body.get("rid")
    if rid is not None and not isinstance(rid, str):
        raise RequestError("rid must be a string (n=1).")
    options = body.get("stream_options") or {}
    stream = bool(body.get("stream", False))
    return {
        "model": str(body.get("model") or UNNAMED_MODEL),
        "rid": rid,
        "stream": stream,
        "include_usage": bool(stream and options.get("include_usage")),
        "continuous_usage": bool(stream and options.get("continuous_usage_stats")),
        "max_tokens": max_tokens,
        "stop": stops,
        "temperature": float(temperature or 0.0),
        "seed": seed if isinstance(seed, int) else None,
        "ignore_eos": bool(body.get("ignore_eos", False)),
    }


_GRAMMAR_MESSAGE = (
    "Grammar-constrained decoding (json_schema/regex/ebnf/structural_tag) is not supported "
    "with DFLASH speculative decoding."
)


def parse_chat(body: dict[str, Any]) -> GenRequest:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("Messages cannot be empty.")
    rendered: list[str] = []
    last_user = ""
    history_calls = 0
    for message in messages:
        if not isinstance(message, dict):
            raise RequestError("Each message must be an object.")
        role = str(message.get("role", "user"))
        text = _text_of(message.get("content"))
        rendered.append(f"<|im_{role}|>{text}<|im_end|>")
        if role == "user":
            last_user = text
        if role == "assistant" and isinstance(message.get("tool_calls"), list):
            history_calls += len(message["tool_calls"])
    tools = _tools(body.get("tools"))
    tool_choice = body.get("tool_choice")
    if tool_choice == "required" and not tools:
        raise RequestError("Tools cannot be empty if tool choice is set to required.")
    if isinstance(tool_choice, dict):
        if not tools:
            raise RequestError("Tools cannot be empty if tool choice is set to a specific tool.")
        name = (tool_choice.get("function") or {}).get("name")
        if name not in {t.name for t in tools}:
            raise RequestError(f"Tool '{name}' not found in tools list.")
    kwargs = body.get("chat_template_kwargs") or {}
    thinking = True
    if isinstance(kwargs, dict):
        for key in ("thinking", "enable_thinking"):
            if key in kwargs:
                thinking = bool(kwargs[key])
    if body.get("separate_reasoning") is False:
        thinking = False
    return GenRequest(
        kind="chat",
        prompt="".join(rendered) + "<|im_assistant|>",
        last_user=last_user,
        thinking=thinking,
        tools=tools,
        tool_choice=tool_choice,
        history_tool_calls=history_calls,
        after_tool_result=messages[-1].get("role") == "tool",
        return_meta_info=bool(body.get("return_meta_info", False)),
        **_common(body),
    )


def parse_completion(body: dict[str, Any]) -> GenRequest:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and not all(isinstance(t, int) for t in prompt):
        # A batch of prompts (strings or token-id arrays); a flat int array is ONE prompt.
        if len(prompt) != 1:
            raise RequestError("Only a single prompt is supported by this worker.")
        prompt = prompt[0]
    if not prompt:
        raise RequestError("Prompt cannot be empty")
    if not isinstance(prompt, (str, list)):
        raise RequestError("The prompt must be a string, an array of strings or of token ids.")
    text = prompt if isinstance(prompt, str) else " ".join(str(t) for t in prompt)
    return GenRequest(kind="completion", prompt=text, last_user=text, **_common(body))


def _tools(raw: Any) -> tuple[Tool, ...]:
    if not isinstance(raw, list):
        return ()
    tools = []
    for item in raw:
        function = item.get("function") if isinstance(item, dict) else None
        if not isinstance(function, dict) or not function.get("name"):
            raise RequestError("Each tool needs a function with a name.")
        params = function.get("parameters")
        tools.append(Tool(str(function["name"]), params if isinstance(params, dict) else {}))
    return tuple(tools)
