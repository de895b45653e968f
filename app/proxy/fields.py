"""Which top-level request fields reach a worker.

Allowed: the OpenAI fields of each route, plus the SGLang and vLLM extensions clients
legitimately send (``chat_template_kwargs`` is Kimi-K2.5's thinking switch on both,
``separate_reasoning``, ``include_reasoning``, sampling knobs, structured output).
``limits.extra_fields`` allows more. One list serves both engines: a request is parsed before its
worker is picked, and each engine ignores the other's extensions (SGLang's request models drop
unknown fields; vLLM's log and ignore them), so an SGLang-only field sent to a vLLM worker (or the
reverse) has no effect there rather than failing.

Denied (a 400 naming the field): SGLang fields that let a client run code on the worker
(``custom_logit_processor``), point it at other hosts (``bootstrap_*``), load adapters
(``lora_path``), pull internals (``return_hidden_states``), pin sessions, jump the queue
(``priority``) or pick the request id the gateway aborts by (``rid``); and vLLM's equivalents:
``request_id`` (its internal id), ``kv_transfer_params`` (other hosts), ``logits_processors`` and
``vllm_xargs`` (code and arguments run on the worker), ``chat_template`` (a client-supplied
template rendered on the worker). A name listed in
``limits.extra_fields`` is allowed even when denied here (``lora_path`` on a multi-LoRA fleet).

Anything else is dropped: not forwarded, counted, logged at debug with its name.

``chat_template_kwargs`` is passed by SGLang (and vLLM) into the tokenizer's
``apply_chat_template(...)`` as keyword arguments: a ``chat_template`` there replaces the served
template (client Jinja rendered on the worker), and other names reach the tokenizer or the
template as variables. Its keys must be on ``limits.chat_template_kwargs`` (by default what
Kimi-K2.5's template and the workers' reasoning switch read: ``thinking``, and ``enable_thinking``,
which SGLang sets beside it); any other key is a 400 naming it (``check_template_kwargs``).

The decoders below read a body's top level as raw byte spans (msgspec), typed only where the
gateway reads a value; ``app.proxy.request`` uses them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Literal

import msgspec
import orjson

from app.errors import InvalidRequest

COMMON = frozenset(
    {
        # OpenAI
        "model",
        "stream",
        "stream_options",
        "max_tokens",
        "temperature",
        "top_p",
        "n",
        "stop",
        "presence_penalty",
        "frequency_penalty",
        "logit_bias",
        "logprobs",
        "seed",
        "user",
        "response_format",
        "metadata",
        "store",
        "service_tier",
        # SGLang sampling and output extensions
        "top_k",
        "min_p",
        "repetition_penalty",
        "stop_token_ids",
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "no_stop_trim",
        "ignore_eos",
        "min_tokens",
        "regex",
        "ebnf",
        "json_schema",
        "return_meta_info",  # the gateway reads it (the exact acceptance length)
        # vLLM sampling and structured-output extensions
        "length_penalty",
        "truncate_prompt_tokens",
        "structured_outputs",
        "guided_json",
        "guided_regex",
        "guided_choice",
        "guided_grammar",
    }
)

CHAT = COMMON | {
    "messages",
    "max_completion_tokens",
    "top_logprobs",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "functions",
    "function_call",
    "reasoning_effort",
    "modalities",
    "audio",
    "prediction",
    "web_search_options",
    "chat_template_kwargs",
    "separate_reasoning",
    "stream_reasoning",
    "continue_final_message",
    # vLLM's reasoning switch and template flags
    "include_reasoning",
    "add_generation_prompt",
}

COMPLETIONS = COMMON | {"prompt", "suffix", "echo", "best_of"}

DENIED = frozenset(
    {
        "custom_logit_processor",
        "custom_params",
        "bootstrap_host",
        "bootstrap_port",
        "bootstrap_room",
        "bootstrap_pair_key",
        "lora_path",
        "lora_id",
        "return_hidden_states",
        "session_params",
        "priority",
        "rid",
        "data_parallel_rank",
        # vLLM
        "request_id",
        "kv_transfer_params",
        "logits_processors",
        "vllm_xargs",
        "chat_template",
    }
)

ABSENT = msgspec.Raw()  # a field not in the body (a present value is never empty)
ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})
Role = Literal["system", "developer", "user", "assistant", "tool", "function"]


class Message(msgspec.Struct, gc=False):
    role: Role = "user"
    content: msgspec.Raw = ABSENT


class StreamOptions(msgspec.Struct, gc=False):
    include_usage: bool | None = None
    continuous_usage_stats: msgspec.Raw = ABSENT


@dataclass(frozen=True, slots=True)
class Schema:
    """The decoders for one route and one set of extra fields (built once, then reused)."""

    # Allowed fields only; the ones the gateway reads typed, the rest raw. A body it reads whole
    # (the common case) is valid as far as the gateway cares, in one pass.
    typed: msgspec.json.Decoder[Any]
    # Allowed and denied fields, all raw, skipping any other (those are dropped).
    spans: msgspec.json.Decoder[Any]
    names: tuple[str, ...]  # the fields of ``spans``, in order
    keys: tuple[bytes, ...]  # each name's comma, JSON key and colon, ready to join
    key_of: dict[str, bytes]  # the same by name
    denied: tuple[str, ...]


# What the gateway reads, typed; UNSET tells a field the client left out from one it set to null.
TYPED: dict[str, tuple[Any, Any]] = {
    "model": (str | msgspec.UnsetType, msgspec.UNSET),
    "messages": (list[Message] | msgspec.UnsetType, msgspec.UNSET),
    "stream": (bool | None, None),
    "stream_options": (StreamOptions | None | msgspec.UnsetType, msgspec.UNSET),
    "user": (str | None, None),
    "max_tokens": (int | None | msgspec.UnsetType, msgspec.UNSET),
    "max_completion_tokens": (int | None | msgspec.UnsetType, msgspec.UNSET),
}


@functools.cache
def schema_for(chat: bool, extra: tuple[str, ...]) -> Schema:
    allowed = sorted((CHAT if chat else COMPLETIONS) | set(extra))
    denied = tuple(sorted(DENIED - set(allowed)))
    names = (*allowed, *denied)
    typed = [(name, *TYPED.get(name, (msgspec.Raw, ABSENT))) for name in allowed]
    spans = [(name, msgspec.Raw, ABSENT) for name in names]
    return Schema(
        typed=msgspec.json.Decoder(msgspec.defstruct("Body", typed, forbid_unknown_fields=True)),
        spans=msgspec.json.Decoder(msgspec.defstruct("Spans", spans)),
        names=names,
        keys=tuple(b"," + orjson.dumps(name) + b":" for name in names),
        key_of={name: b"," + orjson.dumps(name) + b":" for name in names},
        denied=denied,
    )


_KWARGS = msgspec.json.Decoder(dict[str, msgspec.Raw] | None)


def check_template_kwargs(raw: Any, allowed: tuple[str, ...]) -> None:
    """Refuse (``InvalidRequest``, 400 naming it) a ``chat_template_kwargs`` that is neither an
    object nor null, or one holding a key (decoded, as the worker reads it) not in ``allowed``."""
    field = "chat_template_kwargs"
    try:
        kwargs = _KWARGS.decode(raw)
    except msgspec.ValidationError:
        raise InvalidRequest(f"{field}: must be an object", param=field) from None
    for key in kwargs or ():
        if key not in allowed:
            shown = ", ".join(allowed) or "none"
            raise InvalidRequest(
                f"{field}.{key[:64]}: not accepted by this gateway (accepted: {shown}; "
                "see limits.chat_template_kwargs)",
                param=f"{field}.{key[:64]}",
            )


@functools.cache
def capped(count: int) -> msgspec.json.Decoder[Any]:
    """Reads an array of at most ``count`` elements (raw) and stops at element ``count + 1``,
    before the rest is read: the bound holds before any per-element object exists."""
    spec = [(f"e{i}", msgspec.Raw, ABSENT) for i in range(count)]
    capped = msgspec.defstruct("Capped", spec, array_like=True, forbid_unknown_fields=True)
    return msgspec.json.Decoder(capped)
