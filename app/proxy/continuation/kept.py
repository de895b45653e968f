"""A continuable stream's kept reads and the attempts that broke (``KeptReads``, ``Leg``), and
the client's token counts across them (``ContinuedUsage``); see ``app.proxy.continuation``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import orjson

from app.proxy.continuation.partial import (
    _CHARS_PER_TOKEN,
    _ERROR_EVENT,
    Partial,
    _whole,
    read_partial,
)

if TYPE_CHECKING:
    from app.proxy.surface import Observer
    from app.workers.worker import Worker


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
class KeptReads:
    """One continuable stream across its attempts: the relayed upstream reads, by reference,
    and what each attempt that broke streamed (``Leg``), for the next body and the usage."""

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
