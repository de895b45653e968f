"""One upstream attempt of a request, as an object: its rid, worker, response, deadlines, abort,
what the relay saw of it, and how it ended.

    async with Attempt(worker, rid, sup, abort=..., spawn=...) as attempt:
        attempt.responded(await client.open(...))
        await relay_stream(attempt, down, request)
    attempt.outcome  # Outcome.OK, TIMEOUT, CONNECT_ERROR, ...

Whatever ends it from outside goes through the object: the request's ``Supervisor`` calls
``end(Outcome.TIMEOUT)`` when the first-byte or idle deadline passes (the attempt is aborted on
its worker, then whatever it awaits, the worker's response or the client's write, stops there
and the block raises ``UpstreamTimeout``, handled like any failed attempt), and
``abort(reason)`` when the whole request ends (the client left, the total deadline), just before
it ends the request's own ``CancelScope``. On the way out the attempt settles once: its outcome,
exactly one verdict for the worker's circuit breaker (``Worker.attempt_guard``), an abort on the
worker unless the request finished there or provably never ran there (at most one per attempt),
the response closed. Once the request was handed to its connection (``sent``) the abort goes out
at once, before the connection drops. Before that (still connecting) the attempt is stopped
first, so the request is never written after its abort could have reached the worker (and missed
it there); a request never written needs no abort at all.

Time the worker's connection spends paused because the client is behind is not the worker's
silence: the supervisor marks it (``held``) and the idle deadline counts from the later of that
and the last upstream chunk.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING, Any, Protocol

from app.errors import (
    UpstreamConnectError,
    UpstreamError,
    UpstreamStatusError,
    UpstreamTimeout,
)
from app.outcomes import Outcome
from app.proxy.cancel import CancelScope, Ended
from app.upstream.client import UpstreamResponse
from app.upstream.usage import Usage
from app.workers.worker import Verdict, Worker

if TYPE_CHECKING:
    from contextlib import AbstractContextManager

Abort = Callable[[Worker, str], Coroutine[Any, Any, None]]
Spawn = Callable[[Coroutine[Any, Any, None]], None]


class Watch(Protocol):
    """What an attempt needs of whoever watches its deadlines (the request's ``Supervisor``):
    the clock and the deadlines it counts, and to be told when the attempt begins, when the
    worker's response begins and when the attempt is over."""

    clock: Callable[[], float]
    first_byte_s: float
    idle_s: float
    task: asyncio.Task[Any]  # the request's (the attempt's ``CancelScope`` runs in it)

    def begin(self, attempt: Attempt) -> None: ...

    def responded(self) -> None: ...

    def finish(self, attempt: Attempt) -> None: ...


@dataclass(slots=True)
class Tally:
    """What the relay saw of one attempt, for the access record and the metrics."""

    usage: Usage | None = None
    first_at: float | None = None  # clock when the first data event was relayed (commit point)
    chunk_times: list[float] = field(default_factory=list)  # clock at every later relayed chunk
    events: int = 0  # SSE events relayed
    inband_error: bool = False  # the worker's stream carried an error event
    answer_bytes: int = 0  # a non-streamed answer's size, as the worker sent it


class Attempt:
    """One upstream attempt; see the module doc. ``last_rx`` is written by the relay on every
    upstream chunk (one clock read): the idle deadline counts from it."""

    __slots__ = (
        "_abort",
        "_aborted",
        "_cancel_scope",
        "_guard",
        "_instead",
        "_spawn",
        "_verdict",
        "clock",
        "held",
        "last_rx",
        "outcome",
        "partner",
        "reason",
        "response",
        "rid",
        "source",
        "started",
        "sup",
        "tally",
        "worker",
        "written",
    )

    def __init__(
        self,
        worker: Worker,
        rid: str,
        sup: Watch,
        *,
        abort: Abort,
        spawn: Spawn,
        source: str | None = None,
    ) -> None:
        self.worker = worker
        self.source = source  # the request's API key (the breaker's attribution)
        self.rid = rid
        self.sup = sup
        self.clock = sup.clock
        self._abort = abort  # the abort call on a worker (POST /abort_request)
        self._spawn = spawn  # runs an abort in the background
        self._aborted = False
        self._cancel_scope = CancelScope()
        self._guard: AbstractContextManager[Verdict] | None = None
        self._verdict: Verdict | None = None
        self.started = self.last_rx = self.clock()
        # The last time the worker's connection was seen held back for a client that is behind.
        self.held = self.started
        self.written = False  # the request was handed to its connection: it may run there
        self.response: UpstreamResponse | None = None
        self.tally = Tally()
        self.outcome = Outcome.CANCELLED
        self.reason: Outcome | None = None  # why it was ended from outside, if it was
        # What it fails with when ended for another worker's failure (``fail``), not its own.
        self._instead: UpstreamError | None = None
        # With PD disaggregation, the prefill side (``app.proxy.dispatch.pair.Pair.overdue``):
        # asked when the attempt's deadline passes whether the failure is the prefill worker's.
        self.partner: Callable[[], UpstreamError | None] | None = None

    @property
    def receiving(self) -> bool:
        """The worker's response has begun: the idle deadline replaced the first-byte one."""
        return self.response is not None

    @property
    def committed(self) -> bool:
        """The first upstream data event reached the client: no more retries."""
        return self.tally.first_at is not None

    @property
    def status_code(self) -> int:
        """The worker's response status (0 before it responded)."""
        return self.response.status_code if self.response is not None else 0

    def deadline(self) -> float:
        """When the attempt times out (supervisor's clock): first byte, then idle."""
        if self.response is None:
            return self.started + self.sup.first_byte_s
        return max(self.last_rx, self.held) + self.sup.idle_s

    def sent(self) -> None:
        """The request was handed to its connection (called by the upstream client)."""
        self.written = True

    def responded(self, response: UpstreamResponse) -> None:
        """The worker's response headers arrived (2xx)."""
        self.response = response
        self.last_rx = self.clock()
        self.sup.responded()

    async def abort(self, reason: Outcome) -> None:
        """Abort the attempt on its worker (once), recording why. The attempt itself runs on:
        the caller ends it, or the whole request, next. Before the request was written nothing
        is sent: ended first, it is never written (see the module doc)."""
        if self.reason is not None or not self._cancel_scope.running:
            return
        self.reason = reason
        if not self._aborted and self.written:
            self._aborted = True
            await self._abort(self.worker, self.rid)

    async def end(self, reason: Outcome) -> None:
        """Abort it on its worker, then stop it wherever it waits: it raises ``UpstreamTimeout``
        (or, when its ``partner`` says the deadline passed by the prefill worker's fault, that
        failure, with no verdict on this worker)."""
        partner = self.partner
        if reason is Outcome.TIMEOUT and partner is not None and self.reason is None:
            instead = partner()
            if instead is not None:
                await self.fail(instead)
                return
        await self.abort(reason)
        self._cancel_scope.end(reason)

    async def fail(self, error: UpstreamError) -> None:
        """End it for a failure that is not its worker's (its prefill partner's, with PD
        disaggregation): aborted on its worker and stopped like ``end``, it raises ``error``
        and gives its worker's breaker no verdict."""
        if self.reason is not None or not self._cancel_scope.running:
            return
        self._instead = error
        await self.end(Outcome.CANCELLED)

    async def __aenter__(self) -> Attempt:
        guard = self._guard = self.worker.attempt_guard(self.source)
        self._verdict = guard.__enter__()
        self.sup.begin(self)
        self._cancel_scope.enter(self.sup.task)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        error = exc
        try:
            self._cancel_scope.exit(exc_type)
        except Ended:
            error = self._instead or UpstreamTimeout(
                f"worker {self.worker.name} went silent for too long"
                if self.receiving
                else f"worker {self.worker.name} sent no response in time"
            )
        try:
            self.sup.finish(self)
            self._settle(error)
            if self.response is not None:
                if error is None:
                    await self.response.aclose()
                else:  # whatever failed, its connection is not reused
                    self.response.discard()
        finally:
            assert self._guard is not None
            self._guard.__exit__(None, None, None)  # in flight -1, the breaker's verdict
        if error is not None and error is not exc:
            raise error from None

    def _settle(self, error: BaseException | None) -> None:
        """The outcome and the breaker's verdict; an abort on the worker unless the request
        finished there or provably never ran there."""
        verdict = self._verdict
        assert verdict is not None
        abort = True
        if error is None:
            self.outcome, verdict.fault, abort = Outcome.OK, False, False
        elif error is self._instead:  # another worker failed: no verdict on this one
            self.outcome = Outcome.CANCELLED
        elif isinstance(error, UpstreamError):
            self.outcome = error.attempt_outcome
            # A 4xx: the worker answered, the request was at fault. A 5xx: the worker's fault,
            # or the request's (SGLang answers 500 to some bad input): counted against its key.
            answered = isinstance(error, UpstreamStatusError)
            verdict.fault = not answered or error.status >= 500
            verdict.requested = answered
            # Refused connections never reached it; an error status means nothing runs.
            if isinstance(error, UpstreamStatusError) or (
                isinstance(error, UpstreamConnectError) and not self.receiving
            ):
                abort = False
        elif self.reason is Outcome.TIMEOUT:  # the request ran out of time before it answered
            self.outcome, verdict.fault = Outcome.TIMEOUT, True
        else:  # the client left, the gateway stopped, or a fault in the gateway: no verdict
            self.outcome = Outcome.CANCELLED
        if abort and self.written and not self._aborted:  # never written: it never ran there
            self._aborted = True
            self._spawn(self._abort(self.worker, self.rid))
