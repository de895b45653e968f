"""Streams that survive their worker: a chat stream that breaks after the commit point goes on
on another worker, and its client sees one ordinary stream.

While a continuable stream is relayed, the gateway keeps a reference to each upstream read it
relays (``Stream.keeping``; in the relay's direct lane inline: one list append per read, no copy,
no parsing). Only when the stream breaks are those bytes read (``Partial``): the answer's first
``id``, the reasoning and the answer text so far. The next attempt sends the same chat request
with that partial answer as a final assistant message and SGLang's ``continue_final_message``
(``continuation_body``): SGLang
0.5.23 takes the last assistant message's string content out of the conversation and appends it,
as it is, after the assistant's generation prompt (``serving_chat.py``
``_handle_last_assistant_message`` / ``_append_assistant_prefix_to_prompt_ids``); it does not read
that message's ``reasoning_content``. So the reasoning goes into the content the way Kimi-K2.5
writes it: ``<think>`` reasoning, then ``</think>`` and the answer once the answer has begun. Its
reasoning parser reads the same text (``parser/reasoning_parser.py``: ``ReasoningParser`` built
with the request passes it as ``previous_content``; an open ``<think>`` means the new text is
reasoning, a ``</think>`` that it is the answer).
``max_tokens`` is what the client asked less the tokens already streamed: counted exactly when
the continuation's worker counts both prompts (see below: ``Stream.budget``), else estimated (a
token per 4 characters, at least one per chunk).

The continuation's own stream passes through ``Resume`` on its way to the request's surviving
observer (the same one the first attempt fed, so the client-facing surface needs no logic of its
own): its first event must answer the continuation's rid (a stray answer is refused as on any
attempt), its role chunk is dropped (the client had one), every event gets the first attempt's
``id``, and its usage chunk covers every attempt (``Stream.usage``). Only a continued stream pays
for this (one orjson parse and dump per event).

Token counts across attempts (``Leg``): before a continuation starts, the worker it goes to counts
the prompt of the attempt that broke (SGLang's ``POST /v1/tokenize`` with that attempt's chat
fields: the conversation as rendered for it, a continued prefix included). SGLang encodes a
continued prefix on its own and appends its tokens to the conversation's
(``_append_assistant_prefix_to_prompt_ids``), so each attempt's prompt is the one before plus
the tokens of the answer streamed since, as the worker's tokenizer reads them back: with
``P_1 .. P_n`` the attempts' prompt tokens (``P_n`` and ``C_n`` from the last one's usage), the
client is told, and its key charged, ``prompt_tokens = P_1 + ... + P_n`` (every prefill the
workers ran, the continuations' included: the usage log's ``continuation_prompt_tokens`` says how
many of them) and ``completion_tokens = (P_n - P_1) + C_n`` (attempt k streamed
``P_(k+1) - P_k``). Each attempt's share, with the verify steps it relayed, is credited to its
own worker's token and acceptance metrics. When a count is missing (no worker answered the
tokenize call), the streamed tokens are estimated (a token per 4 characters) and the
continuations' prompts left out, as the usage log's ``tokens_estimated`` says.

Reasoning tokens across attempts: SGLang 0.5.23 counts a request's output tokens as reasoning up
to and including the first ``</think>`` it generates (``schedule_batch.py``
``Req.update_reasoning_tokens``, for every ``kimi_k2`` request not sent ``thinking: false``); it
does not look at the prompt, so a continuation started after the thinking closed (the answer had
begun) never generates one and would report every token it streamed as reasoning: it streamed
none (0). An attempt that broke still thinking streamed only reasoning (its share ``P_(k+1) -
P_k``); the one that broke after the answer began, having started inside the reasoning, streamed
the rest of the reasoning, the ``</think>`` and some answer: its reasoning is the tokens up to the
``</think>``, ``T - P_k`` with ``T`` the first attempt's prompt continued with the whole
reasoning closed (``<think>`` reasoning ``</think>``: ``Stream.closing``), counted by the same
tokenize call (``Stream.closed``). So the client's ``reasoning_tokens`` are those of the unbroken
stream. Without that count they are estimated like the rest (a token per 4 characters, plus the
``</think>``), as ``tokens_estimated`` says.

What breaks a stream: the connection dropped or reset, the idle deadline, the end without
``[DONE]``, and after the commit point a worker's in-band error event of the worker's fault (5xx or
no status: held back by the observer, with the ``[DONE]`` after it, instead of relayed:
``Stream.keeping``); a 4xx in-band error is relayed as before.

Not continued: streams that already carried tool-call deltas (SGLang 0.5.23's ``KimiK2Detector``
is given nothing of a continued message: the rest of cut arguments would come back as plain
``content`` with Kimi's tool-call tokens stripped, a further call from index 0 with a colliding
id, the finish ``stop``; docs/routing.md says where in its source) or their finish chunk,
parallel samples (``n`` > 1), text completions (their prompt is no chat), requests that continue
a final assistant message themselves, and whatever the settings
(``retry.mid_stream_attempts`` = 0) or the key's policy (``continue_streams: false``) turn off.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import orjson

from app.errors import UpstreamBadResponse
from app.upstream.sse import answers, foreign, leading_error, parse_usage

if TYPE_CHECKING:
    from app.proxy.surface import Observer
    from app.workers.worker import Worker

_EVENT_END = re.compile(rb"\r?\n\r?\n")
_ERROR_EVENT = re.compile(rb'(?:^|\n)data:[ \t]*\{"error"')
_CHARS_PER_TOKEN = 4


@dataclass(slots=True)
class Partial:
    """What the client has of the answer so far, read from the relayed events."""

    id: str | None = None
    reasoning: str = ""
    content: str = ""
    steps: int = 0  # data events that carried text
    tool_calls: bool = False
    finished: bool = False  # a finish_reason (or [DONE]) was relayed
    role: bool = False  # the role chunk was relayed

    @property
    def continuable(self) -> bool:
        return self.id is not None and self.role and not self.tool_calls and not self.finished

    @property
    def tokens(self) -> int:
        """Estimated completion tokens streamed: a token per 4 characters, at least one per
        step (SGLang sends one chunk per verify step)."""
        chars = len(self.reasoning) + len(self.content)
        return max(self.steps, -(-chars // _CHARS_PER_TOKEN))

    def prefix(self) -> str:
        """The partial answer as the assistant's raw text (see the module doc)."""
        if not self.reasoning:
            return self.content
        if not self.content:
            return "<think>" + self.reasoning
        return "<think>" + self.reasoning + "</think>" + self.content


def _whole(data: bytes) -> bytes:
    """``data`` up to the end of its last whole event."""
    ends = list(_EVENT_END.finditer(data))
    return data[: ends[-1].end()] if ends else b""


def _events(data: bytes) -> list[bytes]:
    return [e for e in _EVENT_END.split(data) if e.strip()]


def _payload(event: bytes) -> bytes | None:
    """The data of an SSE event (None: a comment or other field only)."""
    lines = [ln[5:].strip() for ln in event.splitlines() if ln.startswith(b"data:")]
    return b"".join(lines) if lines else None


def read_partial(data: bytes) -> Partial:
    """The answer so far in the relayed chat events ``data`` (whole events only)."""
    part = Partial()
    reasoning: list[str] = []
    content: list[str] = []
    for event in _events(data):
        payload = _payload(event)
        if payload is None:
            continue
        if payload == b"[DONE]":
            part.finished = True
            continue
        try:
            doc = orjson.loads(payload)
        except orjson.JSONDecodeError:
            continue
        if not isinstance(doc, dict):
            continue
        if part.id is None and isinstance(doc.get("id"), str):
            part.id = doc["id"]
        for choice in doc.get("choices") or ():
            if not isinstance(choice, dict):
                continue
            if choice.get("finish_reason") is not None:
                part.finished = True
            delta = choice.get("delta")
            if not isinstance(delta, dict):
                continue
            if delta.get("role"):
                part.role = True
            if delta.get("tool_calls"):
                part.tool_calls = True
            text = False
            if isinstance(delta.get("reasoning_content"), str) and delta["reasoning_content"]:
                reasoning.append(delta["reasoning_content"])
                text = True
            if isinstance(delta.get("content"), str) and delta["content"]:
                content.append(delta["content"])
                text = True
            part.steps += text
    part.reasoning, part.content = "".join(reasoning), "".join(content)
    return part


@dataclass(slots=True)
class Leg:
    """An attempt of a continued stream that broke: its worker, the verify steps it relayed
    (data events that carried text), what it streamed (estimated tokens), its chat body and that
    body's prompt tokens as a worker counts them (None: not counted); the characters of
    reasoning it streamed and whether the answer had begun when it broke."""

    worker: Worker
    steps: int
    estimate: int
    body: bytes
    prompt_tokens: int | None = None
    reasoning_chars: int = 0
    answered: bool = False


# An attempt's counts: (worker, prompt, completion, verify steps, reasoning); worker None: the last.
Share = tuple["Worker | None", "int | None", int, "int | None", "int | None"]


@dataclass(slots=True)
class ContinuedUsage:
    """A continued stream's token counts: the client's (all attempts) and each attempt's own,
    worker by worker, as (worker, prompt, completion, verify steps, reasoning)."""

    prompt_tokens: int
    completion_tokens: int
    continuation_prompt_tokens: int  # of prompt_tokens: the continuations' prompts
    exact: bool
    shares: list[Share]
    reasoning_tokens: int | None = None  # of completion_tokens (None: the worker reported none)


@dataclass(slots=True)
class Stream:
    """One continuable stream across its attempts: the relayed upstream reads, by reference."""

    chunks: list[bytes] = field(default_factory=list)
    continuations: int = 0  # continuation attempts started
    legs: list[Leg] = field(default_factory=list)  # the attempts that broke, in order
    body: bytes | None = None  # the running continuation's chat body (no rid)...
    next: dict[str, Any] | None = None  # ...as a document
    asked: dict[str, Any] = field(default_factory=dict)  # the client's max_tokens fields
    counted: int | None = None  # the running continuation's prompt tokens, as a worker counted
    last: tuple[int | None, int | None] | None = None  # the last attempt's (prompt, completion)
    closing: bytes | None = None  # the first body continued with the reasoning closed...
    closed: int | None = None  # ...and its prompt tokens, as a worker counted them

    def broke(self, worker: Worker, part: Partial, body: bytes) -> None:
        """The running attempt on ``worker``, sent ``body``, broke after relaying ``part``
        (the whole answer so far)."""
        steps = part.steps - sum(leg.steps for leg in self.legs)
        estimate = part.tokens - sum(leg.estimate for leg in self.legs)
        counted = self.counted if self.body is not None and body is self.body else None
        chars = len(part.reasoning) - sum(leg.reasoning_chars for leg in self.legs)
        leg = Leg(worker, max(0, steps), max(0, estimate), body, counted, max(0, chars))
        leg.answered = bool(part.content)
        self.legs.append(leg)
        self.counted = None

    def budget(self, streamed: int) -> None:
        """The continuation's ``max_tokens``: what the client asked less the ``streamed``
        tokens (counted by a worker; without a count, ``continuation_body`` estimated them)."""
        if self.next is None:
            return
        for name, asked in self.asked.items():
            if isinstance(asked, int) and not isinstance(asked, bool):
                self.next[name] = max(1, asked - streamed)
        self.body = orjson.dumps(self.next)

    def usage(
        self, prompt: int | None, completion: int | None, reasoning: int | None = None
    ) -> ContinuedUsage | None:
        """The client's counts given the last attempt's ``prompt``, ``completion`` and
        ``reasoning`` tokens (see the module doc); None without legs or a completion count."""
        self.last = (prompt, completion)
        legs = self.legs
        if not legs or completion is None:
            return None
        if legs[-1].answered:  # the last attempt began after the thinking closed
            reasoning = 0 if reasoning is not None else None
        counts = [leg.prompt_tokens for leg in legs]
        if prompt is not None and None not in counts:
            prompts = [c for c in counts if c is not None] + [prompt]
            streamed = [max(0, prompts[k + 1] - prompts[k]) for k in range(len(legs))]
            if sum(streamed) == prompt - prompts[0]:  # each attempt's prompt grew
                thought, exact = self._reasoning(streamed, prompts)
                shares: list[Share] = [
                    (leg.worker, prompts[k], streamed[k], leg.steps or None, thought[k])
                    for k, leg in enumerate(legs)
                ]
                return ContinuedUsage(
                    sum(prompts),
                    sum(streamed) + completion,
                    sum(prompts[1:]),
                    exact,
                    [*shares, (None, prompt, completion, None, reasoning)],
                    _total(thought, reasoning),
                )
        estimates = [leg.estimate for leg in legs]
        thought, _ = self._reasoning(estimates, None)
        estimated: list[Share] = [
            (leg.worker, None, leg.estimate, leg.steps or None, thought[k])
            for k, leg in enumerate(legs)
        ]
        return ContinuedUsage(
            prompt or 0,
            sum(estimates) + completion,
            0,
            False,
            [*estimated, (None, prompt, completion, None, reasoning)],
            _total(thought, reasoning),
        )

    def _reasoning(self, streamed: list[int], prompts: list[int] | None) -> tuple[list[int], bool]:
        """Each broken attempt's reasoning tokens, given the tokens it ``streamed`` and (counted)
        the attempts' ``prompts``, and whether they are exact: all of them while it was still
        thinking, none once the answer had begun before it started; for the one that broke
        after the answer began, the tokens up to the ``</think>`` (``closed``, else estimated)."""
        out: list[int] = []
        exact = True
        answered = False
        chars = 0
        for k, leg in enumerate(self.legs):
            chars += leg.reasoning_chars
            if answered or (leg.answered and not chars):  # no thinking in this attempt
                out.append(0)
            elif not leg.answered:
                out.append(streamed[k])
            elif prompts is not None and self.closed is not None and self.closed >= prompts[k]:
                out.append(min(streamed[k], self.closed - prompts[k]))
            else:  # the reasoning it streamed, a token per 4 characters, and the </think>
                out.append(min(streamed[k], -(-leg.reasoning_chars // _CHARS_PER_TOKEN) + 1))
                exact = False
            answered = answered or leg.answered
        return out, exact

    def keeping(self, feed: Callable[[bytes], bytes], obs: Observer) -> Callable[[bytes], bytes]:
        """``feed`` that first keeps a reference to each read it is given, with the observer
        holding back a worker-fault in-band error after the commit point (``obs.broken``: the
        attempt then fails as a broken stream, to be continued; a 4xx error passes as before).
        An observer that cannot (``holds_errors`` false) has its reads looked at here first."""
        keep = self.chunks.append
        if obs.holds_errors:
            obs.hold_errors = True

            def feeding(chunk: bytes) -> bytes:
                keep(chunk)
                return feed(chunk)

            return feeding

        def scanning(chunk: bytes) -> bytes:
            if obs.broken is not None:
                return b""  # what follows the held error: its [DONE]
            if b'{"error"' in chunk and obs.first_data:
                head = obs.hold(chunk)
                if head is not None:
                    obs.done = False  # the translation never saw the stream's end
                    chunk = head
            keep(chunk)
            return feed(chunk)

        return scanning

    def partial(self) -> Partial:
        """The answer so far; the kept reads are cut to their whole events (what the client has),
        so a later continuation's events follow them cleanly."""
        data = _whole(b"".join(self.chunks))
        error = _ERROR_EVENT.search(data)
        if error is not None:  # the held-back error event and what followed it: never relayed
            data = data[: error.start() + (data[error.start()] == 10)]
        self.chunks = [data]
        return read_partial(data)


def _total(legs: list[int], last: int | None) -> int | None:
    """The stream's reasoning tokens: the broken attempts' and the last one's (None: the worker
    reports none)."""
    return None if last is None else sum(legs) + last


def reasoning_closed(body: dict[str, Any], part: Partial) -> bytes:
    """The chat request ``body`` continued with ``part``'s reasoning closed (``<think>``
    reasoning ``</think>``, no answer), without a rid: its prompt tokens less an attempt's are
    the reasoning tokens from that attempt's start to the ``</think>`` (see the module doc)."""
    out = dict(body)
    out.pop("rid", None)
    messages = list(out.get("messages") or ())
    messages.append({"role": "assistant", "content": "<think>" + part.reasoning + "</think>"})
    out["messages"] = messages
    out["continue_final_message"] = True
    return orjson.dumps(out)


def continuation_body(body: dict[str, Any], part: Partial) -> dict[str, Any] | None:
    """The chat request ``body`` (as sent upstream) continued after ``part``, without a rid;
    None for a request that itself continues a final assistant message (not continued)."""
    if body.get("continue_final_message") is True:
        return None
    out = dict(body)
    out.pop("rid", None)
    messages = list(out.get("messages") or ())
    messages.append({"role": "assistant", "content": part.prefix()})
    out["messages"] = messages
    out["continue_final_message"] = True
    for name in ("max_tokens", "max_completion_tokens"):
        asked = out.get(name)
        if isinstance(asked, int) and not isinstance(asked, bool):
            out[name] = max(1, asked - part.tokens)
    return out


class Resume:
    """Turns a continuation's stream into the rest of the client's (see the module doc). Holds
    an unfinished event until its end arrives, like the observers do."""

    __slots__ = ("_carry", "_checked", "_first_id", "_role_dropped", "_stream", "rid", "usage")

    def __init__(self, first_id: str, stream: Stream) -> None:
        self._first_id = first_id
        self.rid = ""  # the continuation attempt's own, set when it starts
        self._stream = stream
        self.usage: ContinuedUsage | None = None  # the stream's counts, once the usage chunk passed
        self._carry = b""
        self._checked = False
        self._role_dropped = False

    def wrap(self, feed: Callable[[bytes], bytes]) -> Callable[[bytes], bytes]:
        def feeding(chunk: bytes) -> bytes:
            out = self.feed(chunk)
            return feed(out) if out else b""

        return feeding

    def feed(self, chunk: bytes) -> bytes:
        data = self._carry + chunk
        whole = _whole(data)
        self._carry = data[len(whole) :]
        if not whole:
            return b""
        out: list[bytes] = []
        for event in _events(whole):
            payload = _payload(event)
            if payload is None or payload == b"[DONE]":
                out.append(event + b"\n\n")
                continue
            if payload.startswith(b'{"error"') and not self._checked:
                raise leading_error(payload + b"\n\n")
            out.append(self._event(payload))
        return b"".join(out)

    def finish(self) -> bytes:
        rest, self._carry = self._carry, b""
        return rest if rest.strip().endswith(b"[DONE]") else b""

    def _event(self, payload: bytes) -> bytes:
        try:
            doc = orjson.loads(payload)
        except orjson.JSONDecodeError:
            raise UpstreamBadResponse("a continuation chunk is not JSON") from None
        if not isinstance(doc, dict):
            raise UpstreamBadResponse("a continuation chunk is not a JSON object")
        if "error" in doc:
            return b"data: " + payload + b"\n\n"
        if not self._checked:
            if not answers(self.rid, doc.get("id")):
                raise foreign(self.rid, doc.get("id"))
            self._checked = True
        doc["id"] = self._first_id
        choices = doc.get("choices")
        if not self._role_dropped and isinstance(choices, list) and choices:
            choice = choices[0]
            delta = choice.get("delta") if isinstance(choice, dict) else None
            if isinstance(delta, dict) and delta.get("role"):
                self._role_dropped = True
                if (
                    not delta.get("content")
                    and not delta.get("reasoning_content")
                    and not delta.get("tool_calls")
                    and choice.get("finish_reason") is None
                ):
                    return b""
                delta.pop("role", None)
        usage = doc.get("usage")
        if isinstance(usage, dict) and "completion_tokens" in usage:
            counts = parse_usage(doc)
            whole = None
            if counts is not None:
                whole = self._stream.usage(
                    counts.prompt_tokens, counts.completion_tokens, counts.reasoning_tokens
                )
            if whole is not None:
                self.usage = whole
                usage["prompt_tokens"] = whole.prompt_tokens
                usage["completion_tokens"] = whole.completion_tokens
                usage["total_tokens"] = whole.prompt_tokens + whole.completion_tokens
                _set_reasoning(usage, whole.reasoning_tokens)
        return b"data: " + orjson.dumps(doc) + b"\n\n"


def _set_reasoning(usage: dict[str, Any], reasoning: int | None) -> None:
    """The stream's reasoning tokens into the usage where the worker put its own: SGLang's
    top-level ``reasoning_tokens`` and ``completion_tokens_details.reasoning_tokens``."""
    if reasoning is None:
        return
    if "reasoning_tokens" in usage:
        usage["reasoning_tokens"] = reasoning
    details = usage.get("completion_tokens_details")
    if isinstance(details, dict):
        details["reasoning_tokens"] = reasoning
    elif reasoning and "completion_tokens_details" in usage:  # null: the last attempt had none
        usage["completion_tokens_details"] = {"reasoning_tokens": reasoning}
