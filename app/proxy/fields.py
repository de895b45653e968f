"""Which top-level request fields reach a worker.

Allowed: the OpenAI fields of each route, plus the SGLang extensions clients legitimately send
(``chat_template_kwargs`` is Kimi-K2.5's thinking switch, ``separate_reasoning``, sampling knobs,
structured output). ``limits.extra_fields`` allows more.

Denied (a 400 naming the field): SGLang fields that let a client run code on the worker
(``custom_logit_processor``), point it at other hosts (``bootstrap_*``), load adapters
(``lora_path``), pull internals (``return_hidden_states``), pin sessions, jump the queue
(``priority``) or pick the request id the gateway aborts by (``rid``). A name listed in
``limits.extra_fields`` is allowed even when denied here (``lora_path`` on a multi-LoRA fleet).

Anything else is dropped: not forwarded, counted, logged at debug with its name.
"""

from __future__ import annotations

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
    }
)
