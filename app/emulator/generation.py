"""One request's output as DFLASH verify steps: reasoning, then an answer or a kimi_k2 tool call.

``Generation.next_step()`` draws the step size from the acceptance model (1..8 tokens) and takes
that many tokens from the request's token stream. A step ends early where the output ends: at the
end-of-turn token (it counts, like SGLang's stop token), at ``max_tokens`` (the final short step is
still one verify step, so ``spec_accept_length = completion_tokens / verify_steps`` as SGLang
computes it) or at a ``stop`` string (the text is cut before it). Accepted drafts per step are the
tokens kept minus the bonus token.

``ignore_eos`` (SGLang's sampling parameter) keeps the answer going until ``max_tokens`` or a
``stop`` string.

Tool calls: when ``tools`` are given and ``tool_choice`` is ``"required"`` or names a function, or
is ``"auto"``/unset and the last user turn mentions a tool's name, the answer is a call to that
tool (the first one mentioned, else the first tool) with arguments made from its JSON schema.
With ``"auto"``/unset, a conversation that ends with a tool's result is answered in text (the
model uses the result), so a tool-use round trip ends.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import orjson

from app.emulator.profiles import BLOCK_SIZE, AcceptanceModel
from app.emulator.requests import GenRequest, Tool
from app.emulator.text import flavour_words, prose, reasoning_words, split_pieces

EOS_TOKEN_ID = 163586  # Kimi-K2.5 <|im_end|>
# Token kinds in the stream.
_R, _C, _HIDDEN, _NAME, _ARG, _EOS = range(6)


@dataclass(slots=True)
class ToolDelta:
    index: int
    id: str | None
    name: str | None
    arguments: str


@dataclass(slots=True)
class Step:
    tokens: int
    reasoning: str = ""
    content: str = ""
    tool_deltas: list[ToolDelta] = field(default_factory=list)


class Generation:
    """Lazily produces the verify steps of one request."""

    def __init__(
        self, req: GenRequest, profile: str, model: AcceptanceModel, rng: random.Random
    ) -> None:
        self._model = model
        self._rng = rng
        self._limit = req.max_tokens
        self._stops = req.stop
        self._tail_len = max((len(s) for s in req.stop), default=0) + 64
        self._tail = ""
        self._history_calls = req.history_tool_calls
        self._tool = _chosen_tool(req)
        self._stream = self._tokens(req, profile)
        self.completion_tokens = 0
        self.reasoning_tokens = 0
        self.step_tokens: list[int] = []
        self.finish_reason: str | None = None
        self.matched_stop: int | str | None = None
        self.tool_called: Tool | None = None

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def abort(self) -> None:
        if self.finish_reason is None:
            self.finish_reason = "abort"
            self.matched_stop = None

    def next_step(self) -> Step | None:
        if self.finish_reason is not None:
            return None
        want = self._model.sample_accepted(self._rng) + 1
        if self._limit is not None:
            want = min(want, self._limit - self.completion_tokens)
            if want <= 0:
                self.finish_reason = "length"
                return None
        step = Step(tokens=0)
        for _ in range(want):
            kind, text = next(self._stream)
            step.tokens += 1
            if kind == _R:
                step.reasoning += text
                self.reasoning_tokens += 1
            elif kind == _C:
                step.content += text
            elif kind == _NAME:
                assert self._tool is not None
                index = self._history_calls
                call_id = f"functions.{self._tool.name}:{index}"
                step.tool_deltas.append(ToolDelta(0, call_id, self._tool.name, ""))
                self.tool_called = self._tool
            elif kind == _ARG:
                if step.tool_deltas and step.tool_deltas[-1].id is None:
                    step.tool_deltas[-1].arguments += text
                else:
                    step.tool_deltas.append(ToolDelta(0, None, None, text))
            elif kind == _EOS:
                self.finish_reason = "tool_calls" if self.tool_called else "stop"
                self.matched_stop = None if self.tool_called else EOS_TOKEN_ID
            if kind in (_R, _C) and self._stops and self._check_stop(step, text):
                break
            if self.finish_reason is not None:
                break
        self.completion_tokens += step.tokens
        self.step_tokens.append(step.tokens)
        limit = self._limit
        if self.finish_reason is None and limit is not None and self.completion_tokens >= limit:
            self.finish_reason = "length"
        return step

    def _check_stop(self, step: Step, text: str) -> bool:
        self._tail = (self._tail + text)[-self._tail_len :]
        for stop in self._stops:
            at = self._tail.find(stop)
            if at < 0:
                continue
            cut = len(self._tail) - at
            if step.content:
                step.content = step.content[: max(0, len(step.content) - cut)]
            else:
                step.reasoning = step.reasoning[: max(0, len(step.reasoning) - cut)]
            self.finish_reason = "stop"
            self.matched_stop = stop
            return True
        return False

    @property
    def correct_drafts(self) -> int:
        return self.completion_tokens - len(self.step_tokens)

    def histogram(self) -> list[int]:
        """Steps by accepted drafts (index 0..7)."""
        counts = [0] * BLOCK_SIZE
        for tokens in self.step_tokens:
            counts[tokens - 1] += 1
        return counts

    def _tokens(self, req: GenRequest, profile: str) -> Iterator[tuple[int, str]]:
        rng = self._rng
        if req.thinking:
            words = reasoning_words()
            n = rng.randint(200, 1500)
            pieces = prose(rng, words)
            for _ in range(n):
                yield _R, next(pieces)
            yield _R, ""  # </think>
        tool = self._tool
        if tool is not None:
            yield _HIDDEN, ""  # <|tool_calls_section_begin|>
            yield _HIDDEN, ""  # <|tool_call_begin|>
            yield _NAME, tool.name
            yield _HIDDEN, ""  # <|tool_call_argument_begin|>
            for piece in split_pieces(_arguments(tool, req.last_user, rng)):
                yield _ARG, piece
            yield _HIDDEN, ""  # <|tool_call_end|>
            yield _HIDDEN, ""  # <|tool_calls_section_end|>
        else:
            pieces = prose(rng, flavour_words(profile))
            for _ in range(rng.randint(60, 600)):
                yield _C, next(pieces)
            while req.ignore_eos:  # SGLang's ignore_eos: only max_tokens or a stop string end it
                yield _C, next(pieces)
        yield _EOS, ""
        while True:  # never reached: the EOS token ends the request
            yield _EOS, ""


def _chosen_tool(req: GenRequest) -> Tool | None:
    if not req.tools or req.kind != "chat" or req.tool_choice == "none":
        return None
    choice = req.tool_choice
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name")
        return next((t for t in req.tools if t.name == name), None)
    if choice in (None, "auto") and req.after_tool_result:
        return None
    mentioned = [t for t in req.tools if t.name in req.last_user]
    if choice == "required":
        return mentioned[0] if mentioned else req.tools[0]
    return mentioned[0] if mentioned else None


def _arguments(tool: Tool, prompt: str, rng: random.Random) -> str:
    props = tool.parameters.get("properties")
    required = tool.parameters.get("required")
    if not isinstance(props, dict):
        return "{}"
    names = [n for n in props if not isinstance(required, list) or n in required] or list(props)
    words = [w.strip(".,?!\"'") for w in prompt.split() if len(w) > 3] or ["value"]
    args: dict[str, Any] = {}
    for name in names:
        schema = props[name] if isinstance(props[name], dict) else {}
        args[name] = _value(schema, words, rng)
    return orjson.dumps(args).decode().replace('":', '": ').replace(',"', ', "')


def _value(schema: dict[str, Any], words: list[str], rng: random.Random) -> Any:
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        return schema["enum"][0]
    kind = schema.get("type")
    if kind == "integer":
        return rng.randint(1, 100)
    if kind == "number":
        return round(rng.uniform(1, 100), 2)
    if kind == "boolean":
        return True
    if kind == "array":
        return [words[rng.randrange(len(words))]]
    if kind == "object":
        return {}
    return words[rng.randrange(len(words))]
