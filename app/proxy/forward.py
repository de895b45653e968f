"""The request path's retry loop: admit → dispatch → attempt → relay, until one answers.

Retries happen only before the commit point (the first upstream ``data:`` event relayed to the
client), on a worker not yet tried, and every failed attempt that may have reached its worker is
aborted there (``POST /abort_request`` with that attempt's rid). After the commit point a failure
becomes ``data: {"error": ...}`` + ``data: [DONE]``: never a silent truncation, never a hang,
unless the stream can go on on another worker (``app.proxy.continuation``).

The loop knows four parts and nothing of their insides:

- where an attempt goes: the ``Dispatch`` (``app.proxy.dispatch``: whole workers, or PD pairs),
  whose ``Target`` gives its body as its worker gets it;
- one attempt: the ``Attempt`` (``app.proxy.attempt``), which owns the rid, the worker, the
  response, the deadlines and the abort, settles its outcome and breaker verdict, and raises
  ``UpstreamTimeout`` when the request's ``Supervisor`` ends it on a first-byte or idle deadline;
- a broken stream going on: the ``Continuation``;
- the request's record: the ``Recorder`` (``app.proxy.record``), its only writer.

The whole request runs in the supervisor's ``cancel_scope``, its error answer included: the total
deadline, the client leaving or a client that reads nothing for ``timeouts.idle_s`` ends it
there (``Ended``), after the running attempt was aborted on its worker. A request ended while its
client is behind never waits for it: the gateway hangs up on it instead of sending the error.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import random
from collections.abc import Callable

from app.accesslog import AccessLog
from app.config import Settings
from app.errors import (
    GatewayError,
    ServiceUnavailable,
    UpstreamError,
    UpstreamForeignAnswer,
    UpstreamTimeout,
)
from app.metrics import Metrics
from app.outcomes import Outcome
from app.proxy.aborts import Aborts
from app.proxy.attempt import Attempt
from app.proxy.cancel import Ended
from app.proxy.continuation import Continuation
from app.proxy.direct import DirectBody
from app.proxy.dispatch import Body, Dispatch, Target
from app.proxy.dispatch.pd import Disaggregation
from app.proxy.dispatch.whole import WholeWorkers
from app.proxy.downstream import Downstream, Receive, Send
from app.proxy.job import Job
from app.proxy.record import Recorder
from app.proxy.relay import checkable, relay_stream, relay_whole
from app.proxy.supervisor import Supervisor
from app.routing.policies import Learns, Policy
from app.upstream.client import UpstreamClient
from app.workers.acceptance import CollapseDetector
from app.workers.admission import Admission
from app.workers.pool import WorkerPool
from app.workers.worker import Worker

__all__ = ["Job", "Proxy"]

log = logging.getLogger(__name__)
Clock = Callable[[], float]


class NoWorker(Exception):
    """No attempt could be admitted; ``error``: the request's error, if that is it."""

    def __init__(self, error: GatewayError | None = None) -> None:
        self.error = error


class Proxy:
    def __init__(
        self,
        *,
        settings: Settings,
        pool: WorkerPool,
        policy: Policy,
        client: UpstreamClient,
        metrics: Metrics,
        access_log: AccessLog,
        clock: Clock,
        rng: random.Random,
        admission: Admission,
        acceptance: CollapseDetector,
    ) -> None:
        """``admission``: the per-worker caps and the queue before them; ``acceptance``: the
        collapse detector each answered request's acceptance length feeds (both built by
        ``create_app``, which also hands ``admission`` to the ops endpoints)."""
        self._settings = settings
        self._client = client
        self._metrics = metrics
        self._clock = clock
        self._rng = rng
        self._aborts = aborts = Aborts(client, metrics)
        self._loop: asyncio.AbstractEventLoop | None = None  # the last request's event loop
        # SGLang's ``priority`` field on every upstream body (the workers schedule by it).
        self._send_priority = settings.workers.priority_scheduling
        self.admission = admission
        self.acceptance = acceptance
        # A policy that learns from every answer (cache_aware's prefix index), and whether the
        # door must hash each prompt's block chain for it.
        learns = policy if isinstance(policy, Learns) else None
        self.hashes_prefix = learns is not None
        self.learns = learns
        self._books = Recorder(
            metrics=metrics,
            access_log=access_log,
            acceptance=acceptance,
            clock=clock,
            learns=learns,
        )
        # Where attempts go (app.proxy.dispatch); ``pd``: the PD dispatch, None for whole workers.
        self.pd: Disaggregation | None = None
        self._dispatch: Dispatch = WholeWorkers(pool, policy)
        if settings.pd.disaggregation:
            self._dispatch = self.pd = Disaggregation(
                settings,
                pool=pool,
                admission=self.admission,
                client=client,
                metrics=metrics,
                rng=rng,
                clock=clock,
                spawn=aborts.spawn,
                abort=aborts.abort,
            )

    async def aclose(self) -> None:
        """Let pending aborts finish (briefly) at shutdown."""
        await self._dispatch.aclose()
        await self._aborts.aclose()

    def now(self) -> float:
        return self._clock()

    def new_rid(self) -> str:
        """32 random hex digits (SGLang aborts by rid prefix: they must not share one)."""
        return f"{self._rng.getrandbits(128):032x}"

    async def run(
        self, job: Job, receive: Receive, send: Send, direct: DirectBody | None = None
    ) -> None:
        down = Downstream(
            send,
            job.echo_id,
            stream=job.request.stream,
            clock=self._clock,
            direct=direct,
            shape=job.request.surface.shape,
            headers=job.response_headers,
        )
        sup = Supervisor(
            receive=receive,
            downstream=down,
            timeouts=self._settings.timeouts,
            clock=self._clock,
            loop=self._loop,
        )
        self._loop = sup.task.get_loop()  # the next request's, most likely
        sup.start()
        cancel = sup.cancel_scope  # ended by the total deadline, the client leaving or stalling
        try:
            cancel.enter(sup.task)  # ``async with cancel``, less its two coroutines
            try:
                failed = await self._forward(job, down, sup)
                if failed is not None:
                    await self._fail(job, down, *failed)
            except BaseException as exc:
                cancel.exit(type(exc))  # raises ``Ended`` if the request was ended
                raise
            cancel.exit(None)
        except Ended as ended:
            await self._ended(job, down, ended.reason)
        except asyncio.CancelledError:
            # Server shutdown: still end an open stream properly, then unwind.
            self._books.shutdown(job.record)
            if down.started and not sup.disconnected and not down.behind():
                with contextlib.suppress(Exception):
                    await down.fail(ServiceUnavailable("the gateway is shutting down"))
            raise
        except Exception:
            # A bug, not a worker failure: log it, but still answer or end the stream properly.
            log.exception("request %s failed inside the gateway", job.request_id)
            self._books.broke(job.record)
            if down.behind():
                down.close()
            elif not sup.disconnected:
                with contextlib.suppress(Exception):
                    await down.fail(GatewayError("internal error"))
        finally:
            await sup.stop()
            self._books.finish(job, sup.disconnected)

    async def _ended(self, job: Job, down: Downstream, reason: Outcome) -> None:
        """The request was ended from outside: the client left (recorded at the end), took
        nothing for too long (hung up on), or the total deadline passed (the error as the answer
        when the client can take it without a wait, else hung up on)."""
        if reason is Outcome.CLIENT_DISCONNECT:
            return
        error = UpstreamTimeout("the request exceeded its total time limit")
        if reason is Outcome.UPSTREAM_TIMEOUT and not down.behind():
            await self._fail(job, down, error, Outcome.UPSTREAM_TIMEOUT)  # sent with no wait
            return
        message = error.message
        if reason is Outcome.CLIENT_TOO_SLOW:
            message = f"the client read nothing for {self._settings.timeouts.idle_s:g}s"
        self._books.ended(job.record, reason, message, down.started)
        down.close()

    async def _fail(
        self, job: Job, down: Downstream, error: GatewayError, outcome: Outcome
    ) -> None:
        """Give up on the request: the error as the answer, or in-band once the stream began."""
        if error.status == 503 and error.retry_after is None:
            error.retry_after = self._settings.admission.retry_after_s
        self._books.failed(job.record, error, outcome, down.started)
        await down.fail(error)

    async def _forward(
        self, job: Job, down: Downstream, sup: Supervisor
    ) -> tuple[GatewayError, Outcome] | None:
        """Attempts until one relays the response (None), or why the request failed: retries
        before the commit point, continuations of a broken chat stream after it."""
        budget_end = self._clock() + self._settings.retry.budget_s
        tried: set[str] = set()
        cont = Continuation.of(job.request, job.tenant, self._settings, self._client, self._metrics)
        error: GatewayError | None = None
        number = tries = 0
        while True:
            number += 1
            try:
                worker = await self._admit(job, tried, cont)
            except NoWorker as stop:
                error = stop.error or error
                break
            target = self._dispatch.target(job, worker, tried)
            self._books.attempting(job.record, number, worker, target)
            if target is None:  # e.g. the last prefill worker left while this one queued
                self.admission.release()
                break
            try:
                if cont is not None:
                    await cont.count(worker)
                await self._attempt(job, worker, target, down, sup, cont)
                if cont is not None:
                    job.continued = cont.succeeded()
                return None
            except UpstreamError as exc:
                target.blame(tried, worker)
                if cont is not None:
                    cont.failed()
                if job.committed:  # the stream goes on on another worker, or ends in-band
                    if cont is None or not cont.continuing:
                        error = exc
                    if not self._goes_on(job, cont, tried):
                        break
                    continue
                error = exc
                tries += 1
                if not self._retrying(job, exc, tries, budget_end, tried, worker):
                    break
                await self._backoff(tries)
            finally:
                self.admission.release()
        return self._gave_up(job, error)

    async def _admit(self, job: Job, tried: set[str], cont: Continuation | None) -> Worker:
        """The next attempt's worker, admitted (counted in flight until ``admission.release``)
        and added to ``tried``; raises ``NoWorker`` when there is none or the queue gave up."""
        continuing = cont is not None and cont.continuing
        asked = self._clock()
        if job.trace is not None:
            job.trace.admitting()
        try:
            candidates, waited = await self.admission.admit(
                functools.partial(
                    self._dispatch.candidates, job.ctx.model, tried, continuing=continuing
                ),
                job.tenant,
            )
        except ServiceUnavailable as exc:  # every worker full: queue full or timed out
            job.queue_wait_s += self._clock() - asked
            if cont is not None and continuing:
                cont.gave_up("no_worker")
                raise NoWorker() from None
            raise NoWorker(exc) from None
        except BaseException:  # ended while queued: the client left, the total deadline
            job.queue_wait_s += self._clock() - asked
            raise
        job.queue_wait_s += waited
        if not candidates:
            if cont is not None and continuing:
                cont.gave_up("no_worker")
            raise NoWorker()
        worker = self._dispatch.pick(job.ctx, candidates)
        tried.add(worker.name)
        return worker

    def _goes_on(self, job: Job, cont: Continuation | None, tried: set[str]) -> bool:
        """After the commit point: whether the broken stream goes on (its next attempt ready)."""
        if cont is None:
            return False
        room = self._dispatch.can_continue(job.ctx.model, tried)
        if not cont.next(job.request, job.attempt, room, job.request_id):
            return False
        self._books.continued(job.record, cont.continuations)
        return True

    def _retrying(
        self,
        job: Job,
        exc: UpstreamError,
        tries: int,
        budget_end: float,
        tried: set[str],
        worker: Worker,
    ) -> bool:
        """Before the commit point: whether the failed attempt is retried on another worker."""
        last = tries == self._settings.retry.max_attempts or self._clock() >= budget_end
        if not exc.retryable or last or not self._dispatch.has_other(job.ctx.model, tried):
            return False
        self._metrics.record_retry(exc.reason)
        log.info("retrying %s after %s on %s", job.request_id, exc.code, worker.name)
        return True

    async def _backoff(self, tries: int) -> None:
        retry = self._settings.retry
        delay = min(retry.backoff_max_s, retry.backoff_base_s * 2 ** (tries - 1))
        await asyncio.sleep(delay * (0.5 + self._rng.random() / 2))

    def _gave_up(self, job: Job, error: GatewayError | None) -> tuple[GatewayError, Outcome]:
        if error is None:
            error = ServiceUnavailable(
                f"no healthy worker is serving {job.ctx.model!r}",
                retry_after=self._settings.admission.retry_after_s,
            )
            return error, Outcome.NO_WORKER
        return error, error.outcome

    async def _attempt(
        self,
        job: Job,
        worker: Worker,
        target: Target,
        down: Downstream,
        sup: Supervisor,
        cont: Continuation | None,
    ) -> None:
        """One attempt on ``worker``, sent by ``target``; a continuable stream's ``cont`` gives
        its lasting observer, kept reads and, going on, its resume state and body."""
        before, request, trace, aborts = job.attempt, job.request, job.trace, self._aborts
        rid, key = self.new_rid(), job.record.key
        attempt = job.attempt = Attempt(
            worker, rid, sup, abort=aborts.abort, spawn=aborts.spawn, source=key
        )
        parts: Body = request.upstream_parts
        if cont is not None:
            cont.begin(attempt, before)
            if cont.continuing:
                parts = cont.body
        priority = job.tenant.priority if self._send_priority else None
        expose = self._settings.expose_accept_length
        headers = job.headers if trace is None else trace.attempt(job, attempt)
        try:
            async with attempt:  # ends on a deadline; settles outcome, breaker, abort, response
                path = request.route.value
                body = target.outgoing(attempt, path, parts(rid, priority), headers)
                # An answer that cannot be checked for its rid: where no stray can wait.
                fresh = not checkable(request, worker)
                attempt.responded(
                    await self._client.open(
                        worker, path, body, headers, sent=attempt.sent, fresh=fresh
                    )
                )
                if not request.stream:
                    limit = self._settings.limits.max_response_bytes
                    await relay_whole(attempt, down, request, limit=limit, expose=expose)
                else:
                    stray = lambda: self._metrics.record_violation(worker.name, "data_after_done")  # noqa: E731
                    await relay_stream(
                        attempt, down, request, expose=expose, stray=stray, cont=cont
                    )
            self._books.relayed(job.record, attempt, request.stream)
        except UpstreamForeignAnswer:
            self._metrics.record_violation(worker.name, "foreign_answer")
            raise
        finally:
            target.close(attempt)
            self._metrics.record_attempt(worker.name, attempt.outcome)
            if trace is not None:
                trace.attempt_ended(attempt)
