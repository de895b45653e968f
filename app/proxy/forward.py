"""forward(): pick a worker → count it in flight → send → relay → record.

Retries happen only before the commit point (the first upstream ``data:`` event relayed to the
client), on a worker not yet tried, and every failed attempt that may have reached its worker is
aborted there (``POST /abort_request`` with that attempt's rid). After the commit point a failure
becomes ``data: {"error": ...}`` + ``data: [DONE]``: never a silent truncation, never a hang.

Each attempt is an ``Attempt`` (``app.proxy.attempt``): it owns the rid, the worker, the response,
the deadlines and the abort, settles its outcome and breaker verdict, and raises
``UpstreamTimeout`` when the request's ``Supervisor`` ends it on a first-byte or idle deadline.
The whole request runs in the supervisor's ``scope``, its error answer included: the total
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
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import orjson

from app.accesslog import AccessLog, AccessRecord
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
from app.proxy.attempt import Attempt
from app.proxy.direct import DirectBody
from app.proxy.downstream import Downstream, Receive, Send
from app.proxy.pd import Disaggregation, Pair
from app.proxy.relay import checkable, relay_stream, relay_whole
from app.proxy.request import ParsedRequest, Route
from app.proxy.resume import (
    ContinuedUsage,
    Resume,
    Stream,
    continuation_body,
    reasoning_closed,
)
from app.proxy.scope import Ended
from app.proxy.supervisor import Supervisor
from app.proxy.surface import Observer
from app.routing.policies import Learns, Policy, RoutingContext
from app.tenants.tenant import Tenant
from app.upstream.client import UpstreamClient
from app.workers.acceptance import CollapseDetector
from app.workers.admission import Admission
from app.workers.pool import WorkerPool
from app.workers.worker import Worker

if TYPE_CHECKING:
    from app.tracing.otel import RequestTrace

log = logging.getLogger(__name__)
Clock = Callable[[], float]
# An attempt's upstream body by its rid and priority (``ParsedRequest.upstream_parts``'s shape).
Body = Callable[[str, "int | None"], tuple["memoryview | bytes", ...]]


@dataclass(slots=True)
class Job:
    """One client request on its way through the gateway."""

    request: ParsedRequest
    headers: list[tuple[bytes, bytes]]  # forwardable client headers
    request_id: str
    ctx: RoutingContext
    record: AccessRecord
    started: float
    tenant: Tenant  # the key's policy and this request's priority class
    # More response headers (the key's rate-limit headers), rendered once at admission.
    response_headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    queue_wait_s: float = 0.0  # time spent in the admission queue
    attempt: Attempt | None = None  # the last upstream attempt
    trace: RequestTrace | None = None  # its spans, when tracing is on
    continued: ContinuedUsage | None = None  # a continued stream's counts, attempt by attempt

    @property
    def committed(self) -> bool:
        """The first upstream data event reached the client: no more retries."""
        return self.attempt is not None and self.attempt.committed


def _continues_on(worker: Worker) -> bool:
    """Whether a broken stream may go on on ``worker``: an SGLang one (or one whose engine is
    not known yet, taken as SGLang), whose ``continue_final_message`` ``app.proxy.resume``
    follows; vLLM's was not checked."""
    engine = worker.engine
    return engine is None or engine.name == "sglang"


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
        self._pool = pool
        self._policy = policy
        # A policy that learns from every answer (cache_aware's prefix index), and whether the
        # door must hash each prompt's block chain for it.
        self._learns = policy if isinstance(policy, Learns) else None
        self.hashes_prefix = self._learns is not None
        self._client = client
        self._metrics = metrics
        self._access = access_log
        self._clock = clock
        self._rng = rng
        self._background: set[asyncio.Task[Any]] = set()
        self._loop: asyncio.AbstractEventLoop | None = None  # the last request's event loop
        # SGLang's ``priority`` field on every upstream body (the workers schedule by it).
        self._send_priority = settings.workers.priority_scheduling
        self.admission = admission
        self.acceptance = acceptance
        # Prefill/decode disaggregation (app.proxy.pd): None for whole workers.
        self.pd: Disaggregation | None = None
        if settings.pd.disaggregation:
            self.pd = Disaggregation(
                settings,
                pool=pool,
                admission=self.admission,
                client=client,
                metrics=metrics,
                rng=rng,
                clock=clock,
                spawn=self._spawn,
                abort=self._abort,
            )

    async def aclose(self) -> None:
        """Let pending aborts finish (briefly) at shutdown."""
        if self.pd is not None:
            await self.pd.aclose()
        if self._background:
            await asyncio.wait(self._background, timeout=2.0)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _abort(self, worker: Worker, rid: str) -> None:
        """Abort an attempt on its worker through the worker's engine (SGLang: a call; vLLM:
        nothing to send, the attempt's closed connection is the abort)."""
        engine = worker.engine
        if engine is not None and not engine.abort_by_call:
            return
        self._metrics.record_abort()
        if engine is None:  # not yet admitted: SGLang's call, as before engines
            acknowledged = await self._client.abort(worker, rid)
        else:
            acknowledged = await engine.abort(self._client, worker, rid)
        if not acknowledged:
            log.info("abort of %s on %s was not acknowledged", rid, worker.name)

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
            job.request_id,
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
        record = job.record
        sup.start()
        scope = sup.scope  # ended by the total deadline, the client leaving or stalling
        try:
            scope.enter(sup.task)  # ``async with scope``, less its two coroutines
            try:
                failed = await self._forward(job, down, sup)
                if failed is not None:
                    await self._fail(job, down, *failed)
            except BaseException as exc:
                scope.exit(type(exc))  # raises ``Ended`` if the scope was ended
                raise
            scope.exit(None)
        except Ended as ended:
            await self._ended(job, down, ended.reason)
        except asyncio.CancelledError:
            # Server shutdown: still end an open stream properly, then unwind.
            record.outcome = Outcome.SHUTDOWN
            if down.started and not sup.disconnected and not down.behind():
                with contextlib.suppress(Exception):
                    await down.fail(ServiceUnavailable("the gateway is shutting down"))
            raise
        except Exception:
            # A bug, not a worker failure: log it, but still answer or end the stream properly.
            log.exception("request %s failed inside the gateway", job.request_id)
            record.outcome, record.status = Outcome.INTERNAL_ERROR, 500
            if down.behind():
                down.close()
            elif not sup.disconnected:
                with contextlib.suppress(Exception):
                    await down.fail(GatewayError("internal error"))
        finally:
            await sup.stop()
            if sup.disconnected and record.outcome is not Outcome.CLIENT_TOO_SLOW:
                record.outcome, record.status = Outcome.CLIENT_DISCONNECT, 499
            end = self._clock()
            record.duration_ms = round((end - job.started) * 1000, 3)
            self._note(job)
            try:
                self._record(job, end)
            except Exception:  # a bug in the metrics must not cost the access record too
                log.exception("request %s: metrics not recorded", job.request_id)
            self._access.emit(record)

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
        record = job.record
        if reason is Outcome.CLIENT_TOO_SLOW:
            idle_s = self._settings.timeouts.idle_s
            record.status, record.error = 499, f"the client read nothing for {idle_s:g}s"
        else:
            record.status, record.error = (200 if down.started else 504), error.message
        record.outcome = reason
        down.close()

    async def _fail(
        self, job: Job, down: Downstream, error: GatewayError, outcome: Outcome
    ) -> None:
        """Give up on the request: the error as the answer, or in-band once the stream began."""
        record = job.record
        if error.status == 503 and error.retry_after is None:
            error.retry_after = self._settings.admission.retry_after_s
        record.outcome, record.error = outcome, error.message
        record.status = 200 if down.started else error.status
        await down.fail(error)

    @staticmethod
    def _note(job: Job) -> None:
        """What the last attempt relayed, into the access record."""
        attempt, record = job.attempt, job.record
        if job.queue_wait_s:
            record.queue_ms = round(job.queue_wait_s * 1000, 3)
        if attempt is None:
            return
        tally = attempt.tally
        record.chunks = tally.events
        if tally.first_at is not None:
            record.ttft_ms = round((tally.first_at - job.started) * 1000, 3)
        if tally.usage is not None:
            record.prompt_tokens = tally.usage.prompt_tokens
            record.completion_tokens = tally.usage.completion_tokens
            record.reasoning_tokens = tally.usage.reasoning_tokens or None

    def _record(self, job: Job, end: float) -> None:
        """The request's metrics, all at once (none were touched while relaying)."""
        metrics, record, request, model = self._metrics, job.record, job.request, job.ctx.model
        if request.stream:
            metrics.record_stream(record.outcome)
        metrics.record_request(record.route, model, record.status, end - job.started)
        metrics.record_queue_wait(job.queue_wait_s, job.tenant.priority_name)
        attempt = job.attempt
        tally = attempt.tally if attempt is not None else None
        usage = tally.usage if tally is not None else None
        if attempt is not None and usage is not None and job.continued is not None:
            self._record_shares(job, attempt.worker, job.continued, usage.verify_steps)
        elif attempt is not None and usage is not None:
            steps = usage.verify_steps
            source: str | None = "exact" if usage.exact else "estimated"
            if record.continuations:
                # A continued stream's steps ran on several workers: no acceptance figure is
                # credited to the last one (its tokens are counted).
                steps = source = None
            mean = attempt.worker.load.accept_length
            if steps is None and usage.completion_tokens and mean:
                # No per-request figure (a non-streamed text completion): the worker's own mean
                # keeps completion_tokens_total / spec_verify_steps_total consistent.
                steps, source = max(1, round(usage.completion_tokens / mean)), None
            metrics.record_tokens(
                model,
                attempt.worker.name,
                prompt=usage.prompt_tokens,
                completion=usage.completion_tokens,
                reasoning=usage.reasoning_tokens,
                verify_steps=steps,
                source=source,
                cached=usage.cached_tokens,
            )
            if self._learns is not None:
                self._learns.answered(job.ctx, attempt.worker, usage)
            if steps and usage.completion_tokens:
                record.accept_length = round(usage.completion_tokens / steps, 3)
                if source is not None:
                    self.acceptance.observe(attempt.worker, usage.completion_tokens / steps)
        if request.stream and tally is not None and tally.first_at is not None:
            metrics.record_stream_timing(
                model,
                ttft_s=tally.first_at - job.started,
                first_at=tally.first_at,
                chunk_times=tally.chunk_times,
                completion_tokens=usage.completion_tokens if usage is not None else None,
            )

    def _record_shares(
        self, job: Job, last: Worker, continued: ContinuedUsage, steps: int | None
    ) -> None:
        """A continued stream's tokens and verify steps, each attempt's on its own worker
        (``app.proxy.resume``); ``steps``: the verify steps of the whole stream."""
        record, model = job.record, job.ctx.model
        record.continuation_prompt_tokens = continued.continuation_prompt_tokens
        record.tokens_estimated = not continued.exact
        total = 0
        for worker, prompt, completion, own, reasoning in continued.shares:
            if worker is None:  # the last attempt: the stream's steps less the others'
                own = steps - total if steps is not None and steps > total else None
                worker = last
            metrics_steps = own if own and completion else None
            self._metrics.record_tokens(
                model,
                worker.name,
                prompt=prompt,
                completion=completion,
                reasoning=reasoning,
                verify_steps=metrics_steps,
                source="estimated" if metrics_steps else None,
            )
            if metrics_steps:
                total += metrics_steps
                self.acceptance.observe(worker, completion / metrics_steps)
        if total:
            record.accept_length = round(continued.completion_tokens / total, 3)

    async def _forward(
        self, job: Job, down: Downstream, sup: Supervisor
    ) -> tuple[GatewayError, Outcome] | None:
        """Attempts until one relays the response (None), or why the request failed: retries
        before the commit point, continuations of a broken chat stream after it."""
        retry = self._settings.retry
        budget_end = self._clock() + retry.budget_s
        tried: set[str] = set()
        error: GatewayError | None = None
        request = job.request
        keep: Stream | None = None
        obs: Observer | None = None
        if self._continuable(job):
            keep = Stream()
            obs = request.surface.observer(request, expose=self._settings.expose_accept_length)
        resume: Resume | None = None
        body: Body | None = None
        number = tries = 0
        while True:
            number += 1
            asked = self._clock()
            if job.trace is not None:
                job.trace.admitting()
            try:
                candidates, waited = await self.admission.admit(
                    functools.partial(self._candidates, job, tried, continuing=resume is not None),
                    job.tenant,
                )
            except ServiceUnavailable as exc:  # every worker full: queue full or timed out
                job.queue_wait_s += self._clock() - asked
                if resume is None:
                    error = exc
                else:
                    self._metrics.record_continuation("no_worker")
                break
            except BaseException:  # ended while queued: the client left, the total deadline
                job.queue_wait_s += self._clock() - asked
                raise
            job.queue_wait_s += waited
            if not candidates:
                if resume is not None:
                    self._metrics.record_continuation("no_worker")
                break
            pd, pair = self.pd, None
            if pd is None:
                worker = self._policy.pick(job.ctx, candidates)
            else:
                worker = pd.decode_policy.pick(job.ctx, candidates)
            tried.add(worker.name)
            job.record.attempts = number
            job.record.worker = worker.name
            try:
                if pd is not None:
                    prefill = pd.pick_prefill(job.ctx, tried)
                    if prefill is None:  # the last prefill worker left while this one queued
                        break
                    job.record.prefill_worker = prefill.name
                    pair = pd.pair(
                        prefill, model=job.ctx.model, stream=request.stream, source=job.record.key
                    )
                if keep is not None and resume is not None:
                    await self._count(keep, worker)
                await self._attempt(
                    job, worker, down, sup, obs=obs, keep=keep, resume=resume, body=body, pair=pair
                )
                if resume is not None:
                    self._metrics.record_continuation("ok")
                    job.continued = resume.usage
                return None
            except UpstreamError as exc:
                if pair is not None:
                    pair.blame(tried, worker)
                if resume is not None:
                    self._metrics.record_continuation("failed")
                if job.committed:
                    if resume is None:
                        error = exc  # the in-band error, should no continuation start
                    if keep is None:
                        break
                    outcome, resume, body = self._continuation(job, keep, tried)
                    if resume is None:
                        self._metrics.record_continuation(outcome)
                        break
                    continue
                error = exc
                tries += 1
                last = tries == retry.max_attempts or self._clock() >= budget_end
                if not exc.retryable or last or not self._has_other(job, tried):
                    break
                self._metrics.record_retry(exc.reason)
                log.info("retrying %s after %s on %s", job.request_id, exc.code, worker.name)
                delay = min(retry.backoff_max_s, retry.backoff_base_s * 2 ** (tries - 1))
                await asyncio.sleep(delay * (0.5 + self._rng.random() / 2))
            finally:
                self.admission.release()
        if error is None:
            error = ServiceUnavailable(
                f"no healthy worker is serving {job.ctx.model!r}",
                retry_after=self._settings.admission.retry_after_s,
            )
            return error, Outcome.NO_WORKER
        return error, error.outcome

    def _candidates(self, job: Job, tried: set[str], *, continuing: bool) -> list[Worker]:
        """The workers an attempt may go to: not tried yet; SGLang ones for a continuation (with
        PD disaggregation: the decode workers, while a prefill worker is left too)."""
        if self.pd is not None:
            return self.pd.candidates(job.ctx.model, tried)
        return [
            w
            for w in self._pool.available(job.ctx.model)
            if w.name not in tried and (not continuing or _continues_on(w))
        ]

    def _continuable(self, job: Job) -> bool:
        """A chat stream of one choice, with continuations on (settings and the key's policy)."""
        request = job.request
        return (
            request.stream
            and request.route is Route.CHAT
            and request.choices == 1
            and self._settings.retry.mid_stream_attempts > 0
            and job.tenant.policy.continue_streams
        )

    def _continuation(
        self, job: Job, keep: Stream, tried: set[str]
    ) -> tuple[str, Resume | None, Body | None]:
        """How the broken stream goes on: a ``Resume`` for the next attempt and its body, or
        (None) the metric outcome saying why it does not."""
        if keep.continuations >= self._settings.retry.mid_stream_attempts:
            return "limit", None, None
        if self.pd is not None:
            available = self.pd.candidates(job.ctx.model, tried)
        else:
            available = self._pool.available(job.ctx.model)
        if not any(w.name not in tried and _continues_on(w) for w in available):
            return "no_worker", None, None
        part = keep.partial()
        if not part.continuable or part.id is None:
            return "not_continuable", None, None
        first = orjson.loads(job.request.upstream_body("0" * 32))
        continued = continuation_body(first, part)
        if continued is None or job.attempt is None:
            return "not_continuable", None, None
        sent = keep.body
        if sent is None:
            first.pop("rid", None)
            sent = orjson.dumps(first)
        keep.broke(job.attempt.worker, part, sent)
        if part.reasoning and part.content and keep.closing is None:
            keep.closing = reasoning_closed(first, part)  # the thinking is over: count it once
        keep.asked = {k: first[k] for k in ("max_tokens", "max_completion_tokens") if k in first}
        keep.next = continued
        keep.body = orjson.dumps(continued)
        keep.continuations += 1
        job.record.continuations = keep.continuations
        log.info(
            "continuing %s after %d characters (continuation %d)",
            job.request_id,
            len(part.reasoning) + len(part.content),
            keep.continuations,
        )

        def body(rid: str, priority: int | None) -> tuple[bytes, ...]:
            head = (keep.body or b"{}")[:-1] + b","  # its budget set by ``_count``
            tail = b'"rid":"' + rid.encode("ascii") + b'"}'
            if priority is None:
                return (head, tail)
            return (head, b'"priority":%d,' % priority, tail)

        return "", Resume(part.id, keep), body

    async def _count(self, keep: Stream, worker: Worker) -> None:
        """Before a continuation on ``worker``: the prompt tokens of the attempts that broke and
        of the continuation, as ``worker`` counts them; from them the tokens streamed so far,
        which set the continuation's ``max_tokens`` (``app.proxy.resume``). Once the answer has
        begun, also the first prompt with the reasoning closed (the reasoning tokens streamed)."""
        for leg in keep.legs:
            if leg.prompt_tokens is None:
                leg.prompt_tokens = await self._client.prompt_tokens(worker, leg.body)
        if keep.closing is not None and keep.closed is None:
            keep.closed = await self._client.prompt_tokens(worker, keep.closing)
        first = keep.legs[0].prompt_tokens if keep.legs else None
        if first is not None and keep.body is not None and keep.asked:
            sent = keep.counted = await self._client.prompt_tokens(worker, keep.body)
            if sent is not None and sent >= first:
                keep.budget(sent - first)

    def _has_other(self, job: Job, tried: set[str]) -> bool:
        if self.pd is not None:
            return bool(self.pd.candidates(job.ctx.model, tried))
        return any(w.name not in tried for w in self._pool.available(job.ctx.model))

    async def _attempt(
        self,
        job: Job,
        worker: Worker,
        down: Downstream,
        sup: Supervisor,
        *,
        obs: Observer | None = None,
        keep: Stream | None = None,
        resume: Resume | None = None,
        body: Body | None = None,
        pair: Pair | None = None,
    ) -> None:
        """One attempt; a continuable stream passes its lasting observer and kept reads, a
        continuation its ``Resume`` and ``body`` too (``app.proxy.resume``); with PD
        disaggregation, ``pair`` is its prefill side (``app.proxy.pd``)."""
        rid = self.new_rid()
        before = job.attempt
        attempt = job.attempt = Attempt(
            worker, rid, sup, abort=self._abort, spawn=self._spawn, source=job.record.key
        )
        if resume is not None and before is not None:
            # The client's stream began with the first attempt: its commit point and chunk times.
            resume.rid = rid
            if obs is not None:
                obs.resumed()
            attempt.tally.first_at = before.tally.first_at
            attempt.tally.chunk_times = before.tally.chunk_times
        parts: Body = job.request.upstream_parts
        if body is not None:
            parts = body
        opener = self._client.open
        if pair is not None:
            pair.bind(attempt)
            parts = pair.body(parts)
            opener = pair.open
        request, record, trace = job.request, job.record, job.trace
        expose = self._settings.expose_accept_length
        headers = job.headers if trace is None else trace.attempt(job, attempt)
        try:
            async with attempt:  # ends on a deadline; settles outcome, breaker, abort, response
                attempt.responded(
                    await opener(
                        worker,
                        request.route.value,
                        parts(rid, job.tenant.priority if self._send_priority else None),
                        headers,
                        sent=attempt.sent,
                        # An answer that cannot be checked for its rid: where no stray can wait.
                        fresh=not checkable(request, worker),
                    )
                )
                if request.stream:
                    await relay_stream(
                        attempt,
                        down,
                        request,
                        expose=expose,
                        stray=lambda: self._metrics.record_violation(
                            worker.name, "data_after_done"
                        ),
                        obs=obs,
                        keep=keep,
                        resume=resume,
                    )
                    record.status = 200
                else:
                    await relay_whole(
                        attempt,
                        down,
                        request,
                        limit=self._settings.limits.max_response_bytes,
                        expose=expose,
                    )
                    record.status = attempt.status_code
            record.outcome = Outcome.UPSTREAM_ERROR if attempt.tally.inband_error else Outcome.OK
        except UpstreamForeignAnswer:
            self._metrics.record_violation(worker.name, "foreign_answer")
            raise
        finally:
            if pair is not None:
                pair.close(attempt)
            self._metrics.record_attempt(worker.name, attempt.outcome)
            if trace is not None:
                trace.attempt_ended(attempt)
