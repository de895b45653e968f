"""forward(): pick a worker → count it in flight → send → relay → record.

Retries happen only before the commit point (the first upstream ``data:`` event relayed to the
client), on a worker not yet tried, and every failed attempt that may have reached its worker is
aborted there (``POST /abort_request`` with that attempt's rid). After the commit point a failure
becomes ``data: {"error": ...}`` + ``data: [DONE]``: never a silent truncation, never a hang.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import random
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from app.accesslog import AccessLog, AccessRecord
from app.config import Settings
from app.errors import (
    GatewayError,
    ServiceUnavailable,
    UpstreamConnectError,
    UpstreamError,
    UpstreamStatusError,
    UpstreamStreamBroken,
    UpstreamTimeout,
)
from app.metrics import Metrics
from app.proxy.direct import DirectBody
from app.proxy.downstream import Downstream, Receive, Send
from app.proxy.relay import Tally, relay_stream, relay_whole
from app.proxy.request import ParsedRequest
from app.proxy.supervisor import DISCONNECT, TIMEOUT, Supervisor
from app.routing.policies import Policy, RoutingContext
from app.upstream.client import UpstreamClient, UpstreamResponse
from app.workers.admission import Admission
from app.workers.pool import WorkerPool
from app.workers.worker import Worker

log = logging.getLogger(__name__)
Clock = Callable[[], float]


@dataclass(slots=True)
class Job:
    """One client request on its way through the gateway."""

    request: ParsedRequest
    headers: list[tuple[bytes, bytes]]  # forwardable client headers
    request_id: str
    ctx: RoutingContext
    record: AccessRecord
    started: float
    queue_wait_s: float = 0.0  # time spent in the admission queue
    tally: Tally = field(default_factory=Tally)  # what the relay saw of the last attempt

    @property
    def committed(self) -> bool:
        """The first upstream data event reached the client: no more retries."""
        return self.record.ttft_ms is not None


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
    ) -> None:
        self._settings = settings
        self._pool = pool
        self._policy = policy
        self._client = client
        self._metrics = metrics
        self._access = access_log
        self._clock = clock
        self._rng = rng
        self._background: set[asyncio.Task[Any]] = set()
        self.admission = Admission(settings.admission, processes=settings.processes, clock=clock)

    async def aclose(self) -> None:
        """Let pending aborts finish (briefly) at shutdown."""
        if self._background:
            await asyncio.wait(self._background, timeout=2.0)

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _abort(self, worker: Worker, rid: str) -> None:
        self._metrics.record_abort()
        if not await self._client.abort(worker, rid):
            log.info("abort of %s on %s was not acknowledged", rid, worker.name)

    def now(self) -> float:
        return self._clock()

    def new_rid(self) -> str:
        """32 random hex digits (SGLang aborts by rid prefix: they must not share one)."""
        return f"{self._rng.getrandbits(128):032x}"

    async def run(
        self, job: Job, receive: Receive, send: Send, direct: DirectBody | None = None
    ) -> None:
        task = asyncio.current_task()
        assert task is not None
        down = Downstream(
            send, job.request_id, stream=job.request.stream, clock=self._clock, direct=direct
        )
        sup = Supervisor(
            task=task,
            receive=receive,
            downstream=down,
            timeouts=self._settings.timeouts,
            clock=self._clock,
        )
        record = job.record
        sup.start()
        try:
            await self._forward(job, down, sup)
        except asyncio.CancelledError:
            if sup.reason is None:
                # Server shutdown: still end an open stream properly, then unwind.
                record.outcome = "shutdown"
                if down.started and not sup.disconnected:
                    with contextlib.suppress(Exception):
                        await down.fail(ServiceUnavailable("the gateway is shutting down"))
                raise
            task.uncancel()
            if sup.reason == TIMEOUT:  # timeouts.total_s ran out between attempts
                error = UpstreamTimeout("the request exceeded its total time limit")
                record.outcome, record.error = "upstream_timeout", error.message
                record.status = 200 if down.started else error.status
                await down.fail(error)
            else:
                record.outcome, record.status = DISCONNECT, 499
        except Exception:
            # A bug, not a worker failure: log it, but still answer or end the stream properly.
            log.exception("request %s failed inside the gateway", job.request_id)
            record.outcome, record.status = "internal_error", 500
            if not sup.disconnected:
                with contextlib.suppress(Exception):
                    await down.fail(GatewayError("internal error"))
        finally:
            await sup.stop()
            if sup.disconnected:
                record.outcome, record.status = DISCONNECT, 499
            end = self._clock()
            record.duration_ms = round((end - job.started) * 1000, 3)
            self._record(job, end)
            self._access.emit(record)

    def _record(self, job: Job, end: float) -> None:
        """The request's metrics, all at once (none were touched while relaying)."""
        metrics, record, request, model = self._metrics, job.record, job.request, job.ctx.model
        if request.stream:
            metrics.record_stream(record.outcome)
        metrics.record_request(request.route.value, model, record.status, end - job.started)
        metrics.record_queue_wait(job.queue_wait_s)
        tally = job.tally
        usage = tally.usage
        if usage is not None and tally.worker is not None:
            steps = usage.verify_steps
            source: str | None = "exact" if usage.exact else "estimated"
            mean = tally.worker.load.accept_length
            if steps is None and usage.completion_tokens and mean:
                # No per-request figure (a non-streamed text completion): the worker's own mean
                # keeps completion_tokens_total / spec_verify_steps_total consistent.
                steps, source = max(1, round(usage.completion_tokens / mean)), None
            metrics.record_tokens(
                model,
                tally.worker.name,
                prompt=usage.prompt_tokens,
                completion=usage.completion_tokens,
                reasoning=usage.reasoning_tokens,
                verify_steps=steps,
                source=source,
            )
        if request.stream and tally.first_at is not None:
            metrics.record_stream_timing(
                model,
                ttft_s=tally.first_at - job.started,
                first_at=tally.first_at,
                chunk_times=tally.chunk_times,
                completion_tokens=usage.completion_tokens if usage is not None else None,
            )

    async def _forward(self, job: Job, down: Downstream, sup: Supervisor) -> None:
        retry = self._settings.retry
        budget_end = self._clock() + retry.budget_s
        tried: set[str] = set()
        error: GatewayError | None = None
        for attempt in range(1, retry.max_attempts + 1):
            try:
                candidates, waited = await self.admission.admit(
                    lambda: [w for w in self._pool.available(job.ctx.model) if w.name not in tried]
                )
            except ServiceUnavailable as exc:  # every worker full: queue full or timed out
                error = exc
                break
            job.queue_wait_s += waited
            if not candidates:
                break
            worker = self._policy.pick(job.ctx, candidates)
            tried.add(worker.name)
            job.record.attempts = attempt
            job.record.worker = worker.name
            worker.breaker.on_attempt()
            try:
                await self._attempt(job, worker, down, sup)
                worker.breaker.on_success()
                return
            except UpstreamError as exc:
                if _worker_fault(exc):
                    worker.breaker.on_failure()
                else:
                    worker.breaker.on_success()  # it answered; the request was at fault
                error = exc
                last = attempt == retry.max_attempts or self._clock() >= budget_end
                if job.committed or not exc.retryable or last or not self._has_other(job, tried):
                    break
                self._metrics.record_retry(exc.reason)
                log.info("retrying %s after %s on %s", job.request_id, exc.code, worker.name)
                delay = min(retry.backoff_max_s, retry.backoff_base_s * 2 ** (attempt - 1))
                await asyncio.sleep(delay * (0.5 + self._rng.random() / 2))
            except BaseException:
                worker.breaker.on_released()  # client gone or shutdown: no verdict
                raise
            finally:
                self.admission.release()
        if error is None:
            error = ServiceUnavailable(
                f"no healthy worker is serving {job.ctx.model!r}",
                retry_after=self._settings.admission.retry_after_s,
            )
            job.record.outcome = "no_worker"
        else:
            job.record.outcome = _outcome(error)
        if error.status == 503 and error.retry_after is None:
            error.retry_after = self._settings.admission.retry_after_s
        job.record.status = 200 if down.started else error.status
        job.record.error = error.message
        await down.fail(error)

    def _has_other(self, job: Job, tried: set[str]) -> bool:
        return any(w.name not in tried for w in self._pool.available(job.ctx.model))

    async def _attempt(self, job: Job, worker: Worker, down: Downstream, sup: Supervisor) -> None:
        rid = self.new_rid()
        body = job.request.upstream_body(rid)
        # Abort on the worker unless the request finished there or provably never ran there.
        abort = True
        outcome = "cancelled"
        response: UpstreamResponse | None = None
        with worker.track():
            sup.begin_attempt()
            sup.abort_attempt = functools.partial(self._abort, worker, rid)
            try:
                response = await self._client.open(
                    worker, job.request.route.value, body, job.headers
                )
                sup.headers_received()
                job.tally = tally = Tally(worker=worker)
                expose = self._settings.expose_accept_length
                if job.request.stream:
                    await relay_stream(
                        job.request,
                        job.record,
                        tally,
                        job.started,
                        worker,
                        response,
                        down,
                        sup,
                        expose=expose,
                    )
                else:
                    await relay_whole(
                        job.request, job.record, tally, worker, response, down, expose=expose
                    )
                abort = False
                outcome = "ok"
            except asyncio.CancelledError:
                if sup.reason != TIMEOUT:
                    raise  # client gone (or shutdown): abort below, then unwind
                _uncancel()
                sup.clear()
                outcome = "timeout"
                raise UpstreamTimeout(
                    f"worker {worker.name} went silent for too long"
                    if sup.receiving
                    else f"worker {worker.name} sent no response in time"
                ) from None
            except UpstreamError as exc:
                outcome = _attempt_outcome(exc)
                # Refused connections never reached it; an error status means nothing runs.
                if isinstance(exc, UpstreamStatusError) or (
                    isinstance(exc, UpstreamConnectError) and not sup.receiving
                ):
                    abort = False
                raise
            finally:
                sup.end_attempt()
                self._metrics.record_attempt(worker.name, outcome)
                if abort and not sup.attempt_aborted:  # else the supervisor already did
                    self._spawn(self._abort(worker, rid))
                if response is not None:
                    await response.aclose()


def _uncancel() -> None:
    task = asyncio.current_task()
    if task is not None:
        task.uncancel()


def _attempt_outcome(exc: UpstreamError) -> str:
    if isinstance(exc, UpstreamTimeout):
        return "timeout"
    if isinstance(exc, UpstreamConnectError):
        return "connect_error"
    if isinstance(exc, UpstreamStatusError):
        return "status_error"
    return "broken"


def _worker_fault(exc: UpstreamError) -> bool:
    """Failures that count against the worker's circuit breaker (not a 4xx: bad request)."""
    return not isinstance(exc, UpstreamStatusError) or exc.status >= 500


def _outcome(error: GatewayError) -> str:
    if isinstance(error, ServiceUnavailable):
        return "no_capacity"
    if isinstance(error, UpstreamTimeout):
        return "upstream_timeout"
    if isinstance(error, UpstreamStreamBroken):
        return "stream_broken"
    return "upstream_error"
