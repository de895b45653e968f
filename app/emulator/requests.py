"""The request fields the emulated worker reads, validated the way SGLang answers (400 bodies).

Bodies are read as plain JSON (no pydantic on the hot path) into ``GenRequest``s
(``app.emulator.genrequest``); the fields both endpoints share are ``app.emulator.fields``. Rules
that differ from a real worker are documented here and there: an unset ``temperature`` counts as
greedy (0) for the acceptance model; at most ``MAX_CHOICES`` generations (``n`` times the prompts
of a batch) per request; ``structural_tag`` constraints are refused (SGLang serves them, also
under DFLASH). Prompt tokens are estimated as one token per 4 characters of the rendered prompt.

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

from dataclasses import replace
from typing import Any

from app.emulator.fields import common, is_int, logprob_count
from app.emulator.genrequest import MAX_CHOICES, GenRequest, RequestError, Tool


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = [p.get("text", "") for p in content if isinstance(p, dict)]
        return "".join(str(p) for p in parts)
    return ""


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
        top_logprobs=logprob_count(body.get("top_logprobs")),
        **common(body),
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
    if isinstance(raw, str) or (isinstance(raw, list) and all(is_int(t) for t in raw)):
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
        logprobs=is_int(logprobs),
        top_logprobs=logprob_count(logprobs),
        **common(body),
    )


def _is_prompt(value: Any) -> bool:
    if isinstance(value, str):
        return bool(value)
    return isinstance(value, list) and bool(value) and all(is_int(t) for t in value)


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
