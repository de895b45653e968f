"""One request's output as DFLASH verify steps: reasoning, then an answer or a kimi_k2 tool call.

``Generation.next_step()`` draws the step size from the acceptance model (1..8 tokens) and takes
that many tokens from the request's token stream. A step ends early where the output ends: at the
end-of-turn token (it counts, like SGLang's stop token), at ``max_tokens`` (the final short step is
still one verify step, so ``spec_accept_length = completion_tokens / verify_steps`` as SGLang
computes it) or at a ``stop`` string (the text is cut before it). Accepted drafts per step are the
tokens kept minus the bonus token.

``ignore_eos`` (SGLang's sampling parameter) keeps the answer going until ``max_tokens`` or a
``stop`` string.

A grammar-constrained request answers, after its reasoning, with text its grammar accepts: JSON
valid against the schema (``app.emulator.schema``), or a match of the ``regex`` / a sentence of the
``ebnf`` grammar (``app.emulator.grammar``); no tool call (SGLang turns tool-call parsing off for a
JSON answer: ``serving_chat.py`` ``_tool_call_parsing_active``). With ``logprobs`` each step also
lists its tokens' log-probabilities (``app.emulator.logprobs``).

Grammar-made text (a constrained answer, a tool call's arguments) is bounded by a ``Budget``
(``app.emulator.grammar``): ``check_expansion`` makes each request's text once, with a fixed seed,
before the request is admitted (past the budget: ``GrammarError``, answered 400); a generation
whose own draw runs past it later takes that checked text instead. So no request makes the
worker's event loop do more than a bounded amount of work in one step.

Tool calls: when ``tools`` are given and ``tool_choice`` is ``"required"`` or names a function, or
is ``"auto"``/unset and the user's own text in the last user turn names a tool as a whole word
(case-sensitive), the answer is a call to that tool (the first of ``tools`` so named, else, for
``"required"``, the first tool) with arguments made from its JSON schema. The user's own text is
the turn less its XML-tagged context blocks (``<system-reminder>...</system-reminder>``,
``<environment_context>...</environment_context>``, any ``<tag>...</tag>``): coding agents put
reminders there that name their tools (Claude Code's name ``Agent``, ``TodoWrite``...), and a
model does not call a tool because a reminder lists it -- an emulator that did would make the
agent call tools, e.g. spawn sub-agents, forever. With ``"auto"``/unset, a conversation that
ends with a tool's result is answered in text (the model uses the result), so a tool-use round
trip ends.

``continue_final_message`` (a request whose final assistant message is continued, e.g. by a
gateway resuming a stream on another worker): the request's text is drawn as for the
conversation without that message, and the steps that produce the given reasoning and answer are
replayed unseen, so a seeded or greedy request resumes exactly where the same request would
have gone on (a step the prefix ends inside is sent from there on). Only the new steps count as
completion tokens; the prefix counts as prompt: SGLang encodes the prefix on its own and appends
its tokens to the conversation's (``_append_assistant_prefix_to_prompt_ids``), and the emulator's
tokenizer encodes the model's own output to the tokens that made it (``prefix_tokens``: the
replayed tokens, less the one the rest of a cut step still counts), so a stream continued after
a break costs, over its two attempts, the completion tokens the unbroken one would have. A
prefix that closes its reasoning with no answer yet (``<think>`` reasoning ``</think>``) counts
the tokens through the ``</think>``: the reasoning tokens of the unbroken answer.
"""

from __future__ import annotations

import bisect
import json
import random
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from app.emulator.genrequest import GenRequest, Tool
from app.emulator.grammar import Budget, GrammarError, ebnf_text, regex_text
from app.emulator.logprobs import LogprobSource, TokenLogprob
from app.emulator.profiles import BLOCK_SIZE, AcceptanceModel
from app.emulator.schema import SchemaValues, prompt_words
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
    logprobs: list[TokenLogprob] = field(default_factory=list)  # only when asked for


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
        self._logprobs: LogprobSource | None = None
        if req.logprobs:
            # Choices that sample the same text (greedy, or one seed) get the same values.
            sampled = req.seed is None and req.temperature > 0
            material = f"{req.kind}|{req.seed}|{req.index if sampled else ''}|{req.prompt}"
            self._logprobs = LogprobSource(material, req.top_logprobs)
        self.completion_tokens = 0
        self.reasoning_tokens = 0
        self.step_tokens: list[int] = []
        self.finish_reason: str | None = None
        self.matched_stop: int | str | None = None
        self.tool_called: Tool | None = None
        self._pending: Step | None = None  # the rest of a step the prefix ended inside
        self.prefix_tokens = 0  # the continued prefix's tokens (counted as prompt)
        self._thought = False  # the </think> was drawn
        self._replayed_reasoning = 0
        if req.continued:
            self._replay(req.prefix_reasoning, req.prefix_content)
            if req.prefix_closed and not req.prefix_content:
                # ``<think>`` reasoning ``</think>``: the tokens through the </think> (the
                # reasoning tokens the answer's generation counts before it).
                self.prefix_tokens = self._replayed_reasoning + (not self._thought)

    def _replay(self, reasoning: str, content: str) -> None:
        """Draw the steps that produced ``reasoning`` and ``content`` (see the module doc)."""
        limit, stops, self._limit, self._stops = self._limit, self._stops, None, ()
        seen_r = seen_c = 0
        while seen_r < len(reasoning) or seen_c < len(content):
            step = self.next_step()
            if step is None:
                break
            seen_r += len(step.reasoning)
            seen_c += len(step.content)
            if seen_r > len(reasoning) or seen_c > len(content):
                rest = Step(tokens=0)
                rest.reasoning = step.reasoning[len(step.reasoning) - (seen_r - len(reasoning)) :]
                rest.content = step.content[len(step.content) - (seen_c - len(content)) :]
                if seen_c > len(content):
                    rest.reasoning = ""
                rest.tokens = 1
                self._pending = rest
                break
            if self.finish_reason is not None:
                break
        self._limit, self._stops = limit, stops
        self.prefix_tokens = self.completion_tokens - (self._pending is not None)
        self._replayed_reasoning = self.reasoning_tokens
        self.completion_tokens = self.reasoning_tokens = 0
        self.step_tokens = []
        if self._pending is not None:
            self.completion_tokens = 1
            self.step_tokens.append(1)
            if self._pending.reasoning:
                self.reasoning_tokens = 1

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def abort(self) -> None:
        if self.finish_reason is None:
            self.finish_reason = "abort"
            self.matched_stop = None

    def next_step(self) -> Step | None:
        if self._pending is not None:
            step, self._pending = self._pending, None
            return step
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
            if self._logprobs is not None:
                step.logprobs.append(self._logprobs.token(self._shown(kind, text)))
            if kind == _R:
                step.reasoning += text
                self.reasoning_tokens += 1
                self._thought = self._thought or not text
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

    def _shown(self, kind: int, text: str) -> str:
        """A token's text as SGLang detokenizes it for logprobs (special tokens included)."""
        if kind == _EOS:
            return "<|im_end|>"
        if kind == _R and not text:
            return "</think>"
        if kind == _NAME:
            return f"functions.{text}:{self._history_calls}"
        return text

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
            yield _HIDDEN, "<|tool_calls_section_begin|>"
            yield _HIDDEN, "<|tool_call_begin|>"
            yield _NAME, tool.name
            yield _HIDDEN, "<|tool_call_argument_begin|>"
            for piece in split_pieces(_checked(_tool_arguments, req, rng)):
                yield _ARG, piece
            yield _HIDDEN, "<|tool_call_end|>"
            yield _HIDDEN, "<|tool_calls_section_end|>"
        elif req.constrained:
            for piece in split_pieces(_checked(_constrained_answer, req, rng)):
                yield _C, piece
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
    if not req.tools or req.kind != "chat" or req.tool_choice == "none" or req.constrained:
        return None
    choice = req.tool_choice
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name")
        return next((t for t in req.tools if t.name == name), None)
    if choice in (None, "auto") and req.after_tool_result:
        return None
    own = own_text(req.last_user)
    mentioned = [t for t in req.tools if _names(own, t.name)]
    if choice == "required":
        return mentioned[0] if mentioned else req.tools[0]
    return mentioned[0] if mentioned else None


# An XML-tagged block (``<tag ...>...</tag>``): context a client added to the user's turn.
# Found as its opening tag and the first closing tag of the same name after it, in one pass over
# each (a single backtracking pattern costs quadratic time on many unclosed tags).
_OPENING = re.compile(r"<([A-Za-z][\w.:-]*)(?:\s[^<>]*)?>")
_CLOSING = re.compile(r"</([A-Za-z][\w.:-]*)\s*>")


def own_text(turn: str) -> str:
    """A user turn's text less its XML-tagged context blocks (see the module doc), each one
    replaced by a space: linear in the turn's length."""
    if "</" not in turn:
        return turn
    closings: dict[str, list[tuple[int, int]]] = {}
    for found in _CLOSING.finditer(turn):
        closings.setdefault(found.group(1), []).append(found.span())
    out: list[str] = []
    at = 0
    for found in _OPENING.finditer(turn):
        spans = closings.get(found.group(1))
        if found.start() < at or not spans:
            continue
        k = bisect.bisect_left(spans, (found.end(), -1))
        if k < len(spans):
            out += (turn[at : found.start()], " ")
            at = spans[k][1]
    return "".join(out) + turn[at:] if out else turn


def _names(text: str, name: str) -> bool:
    """``name`` appears in ``text`` as a whole word."""
    at = text.find(name)
    while at >= 0:
        end = at + len(name)
        before = text[at - 1] if at else " "
        after = text[end] if end < len(text) else " "
        if not (before.isalnum() or before == "_") and not (after.isalnum() or after == "_"):
            return True
        at = text.find(name, at + 1)
    return False


_CHECK_SEED = 0


def check_expansion(req: GenRequest, budget: Budget | None = None) -> None:
    """Make the grammar-made text ``req`` will answer with (a constrained answer or a tool
    call's arguments) once, with the fixed seed a generation falls back on; a ``GrammarError``
    when it cannot be made or takes more than ``budget`` (shared by the choices of a request)."""
    rng = random.Random(_CHECK_SEED)
    if _chosen_tool(req) is not None:
        _tool_arguments(req, rng, budget)
    elif req.constrained:
        _constrained_answer(req, rng, budget)


def _checked(
    make: Callable[[GenRequest, random.Random, Budget | None], str],
    req: GenRequest,
    rng: random.Random,
) -> str:
    """``make``'s text from this generation's ``rng``; when that runs past its budget, the
    text ``check_expansion`` made (within it) from the fixed seed."""
    try:
        return make(req, rng, None)
    except (GrammarError, RecursionError):
        return make(req, random.Random(_CHECK_SEED), None)


def _constrained_answer(req: GenRequest, rng: random.Random, budget: Budget | None) -> str:
    if req.json_schema is not None:
        values = SchemaValues(req.json_schema, prompt_words(req.last_user), rng, budget)
        return json.dumps(values.value(req.json_schema), ensure_ascii=False)
    if req.regex is not None:
        return regex_text(req.regex, rng, budget)
    assert req.ebnf is not None
    return ebnf_text(req.ebnf, rng, budget)


def _tool_arguments(req: GenRequest, rng: random.Random, budget: Budget | None) -> str:
    """Arguments for a call of the chosen tool: the required properties (all when none are
    required)."""
    tool = _chosen_tool(req)
    assert tool is not None
    props = tool.parameters.get("properties")
    required = tool.parameters.get("required")
    if not isinstance(props, dict):
        return "{}"
    names = [n for n in props if not isinstance(required, list) or n in required] or list(props)
    values = SchemaValues(tool.parameters, prompt_words(req.last_user), rng, budget)
    args = {name: values.value(props[name]) for name in names}
    return json.dumps(args, ensure_ascii=False)
