"""Streams that survive their worker: a chat stream that breaks after the commit point goes on
on another worker, and its client sees one ordinary stream.

The part is ``Continuation`` (here): it owns the stream's kept reads (``kept.py``), the resume
state of the attempt that goes on (``resume.py``) and the next attempt's body (built from what
the client has, ``partial.py``); the retry loop asks it whether and how to go on.

While a continuable stream is relayed, the gateway keeps a reference to each upstream read it
relays (``KeptReads.keeping``; in the relay's direct lane inline: one list append per read, no copy,
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
the continuation's worker counts both prompts (see below: ``KeptReads.budget``), else estimated (a
token per 4 characters, at least one per chunk).

The continuation's own stream passes through ``Resume`` on its way to the request's surviving
observer (the same one the first attempt fed, so the client-facing surface needs no logic of its
own): its first event must answer the continuation's rid (a stray answer is refused as on any
attempt), its role chunk is dropped (the client had one), every event gets the first attempt's
``id``, and its usage chunk covers every attempt (``KeptReads.usage``). Only a continued stream pays
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
reasoning closed (``<think>`` reasoning ``</think>``: ``KeptReads.closing``), counted by the same
tokenize call (``KeptReads.closed``). So the client's ``reasoning_tokens`` are those of the unbroken
stream. Without that count they are estimated like the rest (a token per 4 characters, plus the
``</think>``), as ``tokens_estimated`` says.

What breaks a stream: the connection dropped or reset, the idle deadline, the end without
``[DONE]``, and after the commit point a worker's in-band error event of the worker's fault (5xx or
no status: held back by the observer, with the ``[DONE]`` after it, instead of relayed:
``KeptReads.keeping``); a 4xx in-band error is relayed as before.

Not continued: streams that already carried tool-call deltas (SGLang 0.5.23's ``KimiK2Detector``
is given nothing of a continued message: the rest of cut arguments would come back as plain
``content`` with Kimi's tool-call tokens stripped, a further call from index 0 with a colliding
id, the finish ``stop``; docs/routing.md says where in its source) or their finish chunk,
parallel samples (``n`` > 1), text completions (their prompt is no chat), requests that continue
a final assistant message themselves, and whatever the settings
(``retry.mid_stream_attempts`` = 0) or the key's policy (``continue_streams: false``) turn off.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import orjson

from app.proxy.continuation.kept import ContinuedUsage, KeptReads
from app.proxy.continuation.partial import continuation_body, reasoning_closed
from app.proxy.continuation.resume import Resume
from app.proxy.request import Route

if TYPE_CHECKING:
    from app.config import Settings
    from app.metrics import Metrics
    from app.proxy.attempt import Attempt
    from app.proxy.request import ParsedRequest
    from app.tenants.tenant import Tenant
    from app.upstream.client import UpstreamClient
    from app.workers.worker import Worker

__all__ = ["Continuation", "ContinuedUsage", "KeptReads", "Resume"]

log = logging.getLogger(__name__)


class Continuation:
    """One continuable chat stream across its attempts: the observer that outlives them
    (``obs``), the kept reads (``kept``), and once an attempt broke after the commit point, the
    ``Resume`` of the attempt that goes on and its body (``body``). See the module doc."""

    __slots__ = ("_client", "_limit", "_metrics", "kept", "obs", "resume")

    def __init__(
        self,
        request: ParsedRequest,
        *,
        expose: bool,
        limit: int,
        client: UpstreamClient,
        metrics: Metrics,
    ) -> None:
        """``limit``: the continuations a stream may have (``retry.mid_stream_attempts``)."""
        self.kept = KeptReads()
        self.obs = request.surface.observer(request, expose=expose)
        self.resume: Resume | None = None  # the attempt that goes on, once one broke
        self._limit = limit
        self._client = client
        self._metrics = metrics

    @classmethod
    def of(
        cls,
        request: ParsedRequest,
        tenant: Tenant,
        settings: Settings,
        client: UpstreamClient,
        metrics: Metrics,
    ) -> Continuation | None:
        """The request's ``Continuation`` if it is continuable: a chat stream of one choice, with
        continuations on (``retry.mid_stream_attempts``, the key's ``continue_streams``)."""
        limit = settings.retry.mid_stream_attempts
        if not (
            request.stream
            and request.route is Route.CHAT
            and request.choices == 1
            and limit > 0
            and tenant.policy.continue_streams
        ):
            return None
        return cls(
            request,
            expose=settings.expose_accept_length,
            limit=limit,
            client=client,
            metrics=metrics,
        )

    @property
    def continuing(self) -> bool:
        """The next attempt goes on with a broken stream."""
        return self.resume is not None

    @property
    def continuations(self) -> int:
        return self.kept.continuations

    def gave_up(self, outcome: str) -> None:
        """A continuation could not start (``outcome``: the metric's reason)."""
        self._metrics.record_continuation(outcome)

    def failed(self) -> None:
        """An attempt failed: counted when it was a continuation."""
        if self.resume is not None:
            self._metrics.record_continuation("failed")

    def succeeded(self) -> ContinuedUsage | None:
        """The attempt relayed the rest of the stream: the client's counts across attempts, when
        it was a continuation."""
        if self.resume is None:
            return None
        self._metrics.record_continuation("ok")
        return self.resume.usage

    def begin(self, attempt: Attempt, before: Attempt | None) -> None:
        """A new attempt: a continuation's carries the client's stream on (its commit point and
        chunk times began with the first attempt)."""
        resume = self.resume
        if resume is None or before is None:
            return
        resume.rid = attempt.rid
        self.obs.resumed()
        attempt.tally.first_at = before.tally.first_at
        attempt.tally.chunk_times = before.tally.chunk_times

    def next(
        self, request: ParsedRequest, broken: Attempt | None, room: bool, request_id: str
    ) -> bool:
        """After ``broken`` broke the stream: whether it goes on (the ``Resume`` and the body of
        the next attempt ready), else the metric says why not. ``room``: some worker not yet
        tried may take a continuation."""
        kept = self.kept
        self.resume = None
        if kept.continuations >= self._limit:
            return self._stop("limit")
        if not room:
            return self._stop("no_worker")
        part = kept.partial()
        if not part.continuable or part.id is None:
            return self._stop("not_continuable")
        first = orjson.loads(request.upstream_body("0" * 32))
        continued = continuation_body(first, part)
        if continued is None or broken is None:
            return self._stop("not_continuable")
        sent = kept.body
        if sent is None:
            first.pop("rid", None)
            sent = orjson.dumps(first)
        kept.broke(broken.worker, part, sent)
        if part.reasoning and part.content and kept.closing is None:
            kept.closing = reasoning_closed(first, part)  # the thinking is over: count it once
        kept.asked = {k: first[k] for k in ("max_tokens", "max_completion_tokens") if k in first}
        kept.next = continued
        kept.body = orjson.dumps(continued)
        kept.continuations += 1
        log.info(
            "continuing %s after %d characters (continuation %d)",
            request_id,
            len(part.reasoning) + len(part.content),
            kept.continuations,
        )
        self.resume = Resume(part.id, kept)
        return True

    def _stop(self, outcome: str) -> bool:
        self.gave_up(outcome)
        return False

    def body(self, rid: str, priority: int | None) -> tuple[bytes, ...]:
        """The running continuation's upstream body (its budget set by ``count``)."""
        head = (self.kept.body or b"{}")[:-1] + b","
        tail = b'"rid":"' + rid.encode("ascii") + b'"}'
        if priority is None:
            return (head, tail)
        return (head, b'"priority":%d,' % priority, tail)

    async def count(self, worker: Worker) -> None:
        """Before a continuation on ``worker``: the prompt tokens of the attempts that broke and
        of the continuation, as ``worker`` counts them; from them the tokens streamed so far,
        which set the continuation's ``max_tokens`` (see the module doc). Once the answer has
        begun, also the first prompt with the reasoning closed (the reasoning tokens streamed).
        Nothing before the stream broke."""
        if self.resume is None:
            return
        kept, client = self.kept, self._client
        for leg in kept.legs:
            if leg.prompt_tokens is None:
                leg.prompt_tokens = await client.prompt_tokens(worker, leg.body)
        if kept.closing is not None and kept.closed is None:
            kept.closed = await client.prompt_tokens(worker, kept.closing)
        first = kept.legs[0].prompt_tokens if kept.legs else None
        if first is not None and kept.body is not None and kept.asked:
            sent = kept.counted = await client.prompt_tokens(worker, kept.body)
            if sent is not None and sent >= first:
                kept.budget(sent - first)
