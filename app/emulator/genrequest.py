"""What one generation of the emulated worker asks for (``GenRequest``), and the error a request
that cannot be served is answered with (``RequestError``: SGLang's ``ErrorResponse``).

Prompt tokens are estimated as one token per ``CHARS_PER_TOKEN`` characters of the rendered
prompt; at most ``MAX_CHOICES`` generations (``n`` times the prompts of a batch) per request.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

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
