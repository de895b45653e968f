"""The request fields the emulated worker reads, validated the way SGLang answers (400 bodies).

Bodies are read as plain JSON (no pydantic on the hot path). Rules that differ from a real worker
are documented here: an unset ``temperature`` counts as greedy (0) for the acceptance model;
at most ``MAX_CHOICES`` generations (``n`` times the prompts of a batch) per request;
``structural_tag`` constraints are refused (SGLang serves them, also under DFLASH). Prompt tokens
are estimated as one token per 4 characters of the rendered prompt.

What SGLang 0.5.23 does and the emulator follows (``sglang/srt/...``):

* ``n`` > 1 (chat and text completions, streamed or not) and a batch of prompts (text
  completions: a list of strings or of token-id lists) become one generation per (prompt, sample),
  in prompt-major order: choice ``index = prompt * n + sample`` (``managers/tokenizer_manager.py``
  ``_handle_batch_request``). Request ids: a single request keeps ``rid``; a batch without
  parallel sampling gets ``f"{rid}_{i}"`` or the i-th of a ``rid`` list (``managers/io_struct.py``
  ``GenerateReqInput._normalize_rid``); parallel samples always get fresh ids
  (``regenerate_rid``), so an abort by the caller's rid prefix does not reach them.
* ``response_format`` ``json_schema`` / ``json_object`` and the ``json_schema``, ``regex`` and
  ``ebnf`` fields are served (after the reasoning: ``constrained/reasoner_grammar_backend.py``
  ``ReasonerGrammarObject`` defers a grammar to the end of the reasoning):
  DFLASH verifies drafts under the grammar mask (``speculative/dflash_worker_v2.py``: ``GrammarTree
  .from_linear_chain`` and ``build_grammar_vocab_mask`` in the verify step; ``speculative/
  spec_info.py`` ``supports_grammar_overlap`` is true for the DFLASH family). A ``json_schema``
  format without ``schema`` is refused with SGLang's message (``serving_chat.py``
  ``_validate_request``).
* ``logprobs``/``top_logprobs`` (chat) and ``logprobs`` (text completions) are served: the DFLASH
  verify step computes them (``compute_spec_logprobs`` in ``dflash_worker_v2.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Literal

import orjson

CHARS_PER_TOKEN = 4
# Generations one request may ask for (``n`` times the prompts of a batch): a real worker queues
# any number; the emulator keeps each in memory for the whole request.
MAX_CHOICES = 256
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
    n: int = 1
    index: int = 0  # the choice this generation answers (``prompt * n + sample``)
    prompts: tuple[str, ...] = ()  # a text-completion batch (``prompt`` is the first)
    rids: tuple[str, ...] | None = None  # a batch's own ``rid`` list
    logprobs: bool = False
    top_logprobs: int = 0
    json_schema: dict[str, Any] | None = None  # the answer is JSON valid against it
    regex: str | None = None  # the answer matches it
    ebnf: str | None = None  # the answer is a sentence of this grammar
    priority: int | None = None  # SGLang's scheduling priority (used with priority scheduling)
    # Prefill/decode disaggregation (``app.emulator.disagg``): where the prefill server's
    # bootstrap server is, and the room (one per generation: ``room + index``, as SGLang's
    # ``_normalize_bootstrap_params`` numbers a batch's rooms).
    bootstrap_host: str | None = None
    bootstrap_port: int | None = None
    bootstrap_room: int | None = None
    # ``continue_final_message``: the final assistant message's text, split at ``</think>`` into
    # the reasoning and the answer it already holds (the generation resumes after them).
    prefix_reasoning: str = ""
    prefix_content: str = ""
    prefix_closed: bool = False  # the prefix holds the ``</think>``

    @property
    def constrained(self) -> bool:
        return self.json_schema is not None or self.regex is not None or self.ebnf is not None

    @property
    def prompt_tokens(self) -> int:
        """The rendered conversation's tokens; a continued prefix's are added by its
        ``Generation`` (``prefix_tokens``)."""
        return max(1, -(-len(self.prompt) // CHARS_PER_TOKEN))

    @property
    def continued(self) -> bool:
        return bool(self.prefix_reasoning or self.prefix_content)


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = [p.get("text", "") for p in content if isinstance(p, dict)]
        return "".join(str(p) for p in parts)
    return ""


def _common(body: dict[str, Any]) -> dict[str, Any]:
    n = body.get("n", 1)
    if n is None:
        n = 1
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise RequestError("n must be a positive integer.")
    if n > MAX_CHOICES:
        raise RequestError(f"n must be at most {MAX_CHOICES} on this emulated worker.")
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
    rids: tuple[str, ...] | None = None
    if isinstance(rid, list) and all(isinstance(r, str) for r in rid):
        rids, rid = tuple(rid), None
    elif rid is not None and not isinstance(rid, str):
        raise RequestError("The rid should be a string or a list of strings.")
    priority = body.get("priority")
    if priority is not None and (
        not isinstance(priority, int) or isinstance(priority, bool) or not _int64(priority)
    ):
        raise RequestError(
            "priority must be a signed 64-bit integer "
            "between -9223372036854775808 and 9223372036854775807"
        )
    options = body.get("stream_options")
    if options is None:
        options = {}
    elif not isinstance(options, dict):
        raise RequestError("stream_options must be an object.")
    stream = bool(body.get("stream", False))
    return {
        **_bootstrap(body),
        "priority": priority,
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
        "n": n,
        "rids": rids,
        "json_schema": _json_schema(body),
        "regex": _grammar(body, "regex"),
        "ebnf": _grammar(body, "ebnf"),
    }


def _bootstrap(body: dict[str, Any]) -> dict[str, Any]:
    """``bootstrap_host`` / ``bootstrap_port`` / ``bootstrap_room`` (SGLang's ``PDRoutingFields``),
    single values; a list (SGLang's batch form) is refused."""
    host, port, room = (body.get(k) for k in ("bootstrap_host", "bootstrap_port", "bootstrap_room"))
    if host is not None and not isinstance(host, str):
        raise RequestError("bootstrap_host must be a string.")
    if port is not None and (not _is_int(port) or not 0 < port < 65536):
        raise RequestError("bootstrap_port must be a port number.")
    if room is not None and (not _is_int(room) or not 0 <= room < (1 << 63)):
        raise RequestError("bootstrap_room must be a non-negative 64-bit integer.")
    return {"bootstrap_host": host, "bootstrap_port": port, "bootstrap_room": room}


def _int64(value: int) -> bool:
    return -(1 << 63) <= value < (1 << 63)


def _grammar(body: dict[str, Any], name: str) -> Any:
    """A ``regex``/``ebnf`` field: a non-empty string (what it generates is checked once the
    request is read: ``app.emulator.openai.check_grammars``)."""
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise RequestError(f"{name} must be a non-empty string.")
    return value


def _json_schema(body: dict[str, Any]) -> dict[str, Any] | None:
    """The JSON schema the answer must follow (``response_format`` json_schema/json_object, or
    the ``json_schema`` field as a string); None when unconstrained. ``structural_tag``: 400."""
    fmt = body.get("response_format")
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "json_schema":
        assert isinstance(fmt, dict)
        spec = fmt.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else fmt.get("schema")
        if not isinstance(schema, dict):
            raise RequestError("schema_ is required for json_schema response format request.")
        return schema
    if kind == "json_object":
        return {"type": "object"}
    if kind is not None and kind != "text":
        raise RequestError(_GRAMMAR_MESSAGE)
    raw = body.get("json_schema")
    if isinstance(raw, str) and raw:
        try:
            parsed = orjson.loads(raw)
        except orjson.JSONDecodeError:
            raise RequestError("json_schema must be a JSON schema (a JSON string).") from None
        return parsed if isinstance(parsed, dict) else {}
    return None


_GRAMMAR_MESSAGE = (
    "This emulated worker does not generate structural_tag output (json_schema, json_object, "
    "regex and ebnf are served)."
)


def parse_chat(body: dict[str, Any]) -> GenRequest:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("Messages cannot be empty.")
    rendered: list[str] = []
    last_user = ""
    history_calls = 0
    prefix = ("", "", False)
    last = messages[-1]
    if (
        body.get("continue_final_message") is True
        and isinstance(last, dict)
        and last.get("role") == "assistant"
        and isinstance(last.get("content"), str)
    ):
        # SGLang 0.5.23 (``serving_chat.py`` ``_handle_last_assistant_message``): the message
        # is taken out of the conversation and its string content appended, as it is, after the
        # assistant's generation prompt; ``reasoning_content`` is not read.
        messages = messages[:-1]
        prefix = _split_prefix(last["content"])
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
        function = tool_choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str):
            raise RequestError("tool_choice.function.name must be a string.")
        if name not in {t.name for t in tools}:
            raise RequestError(f"Tool '{name}' not found in tools list.")
    elif tool_choice not in (None, "auto", "required", "none"):
        raise RequestError(
            "tool_choice must be 'none', 'auto', 'required' or a named function "
            '({"type": "function", "function": {"name": ...}}).'
        )
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
        after_tool_result=bool(messages) and messages[-1].get("role") == "tool",
        prefix_reasoning=prefix[0],
        prefix_content=prefix[1],
        prefix_closed=prefix[2],
        return_meta_info=bool(body.get("return_meta_info", False)),
        logprobs=body.get("logprobs") is True,
        top_logprobs=_count(body.get("top_logprobs")),
        **_common(body),
    )


def _split_prefix(text: str) -> tuple[str, str, bool]:
    """An assistant prefix as (reasoning, answer, whether the reasoning is closed): Kimi's raw
    output is ``<think>`` reasoning ``</think>`` answer; an open ``<think>`` without its end is
    reasoning still under way."""
    if text.startswith("<think>"):
        body = text[len("<think>") :]
        reasoning, end, answer = body.partition("</think>")
        return reasoning, answer if end else "", bool(end)
    return "", text, False


def parse_completion(body: dict[str, Any]) -> GenRequest:
    raw = body.get("prompt")
    if not raw or (isinstance(raw, list) and all(not p for p in raw)):
        raise RequestError("Prompt cannot be empty")
    if isinstance(raw, str) or (isinstance(raw, list) and all(_is_int(t) for t in raw)):
        batch = [raw]  # a flat token-id array is ONE prompt
    elif isinstance(raw, list) and all(_is_prompt(p) for p in raw):
        batch = list(raw)
    else:
        raise RequestError("The prompt must be a string, an array of strings or of token ids.")
    texts = tuple(p if isinstance(p, str) else " ".join(str(t) for t in p) for p in batch)
    logprobs = body.get("logprobs")
    return GenRequest(
        kind="completion",
        prompt=texts[0],
        last_user=texts[0],
        prompts=texts if len(texts) > 1 else (),
        logprobs=_is_int(logprobs),
        top_logprobs=_count(logprobs),
        **_common(body),
    )


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_prompt(value: Any) -> bool:
    if isinstance(value, str):
        return bool(value)
    return isinstance(value, list) and bool(value) and all(_is_int(t) for t in value)


_MAX_TOP_LOGPROBS = 64  # beyond this the emulator lists only 64 alternatives


def _count(value: Any) -> int:
    return max(0, min(value, _MAX_TOP_LOGPROBS)) if _is_int(value) else 0


def expand(req: GenRequest) -> list[GenRequest]:
    """One generation per (prompt, sample), prompt-major, with SGLang's request ids."""
    prompts = req.prompts or (req.prompt,)
    if req.rids is not None and len(req.rids) != len(prompts):
        raise RequestError(
            "The specified rids length mismatch with the batch_size for batch processing."
        )
    if len(prompts) * req.n > MAX_CHOICES:
        raise RequestError(f"At most {MAX_CHOICES} generations (n x prompts) per request.")
    if len(prompts) == 1 and req.n == 1:
        return [replace(req, rid=req.rids[0] if req.rids else req.rid)]
    out = []
    for i, prompt in enumerate(prompts):
        rid: str | None = None
        if req.n == 1 and req.rids is not None:
            rid = req.rids[i]
        elif req.n == 1 and req.rid is not None:
            rid = f"{req.rid}_{i}"
        for j in range(req.n):
            index = i * req.n + j
            room = None if req.bootstrap_room is None else req.bootstrap_room + index
            out.append(
                replace(
                    req, prompt=prompt, last_user=prompt, index=index, rid=rid, bootstrap_room=room
                )
            )
    return out


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
