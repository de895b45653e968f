"""The request's record: the one part that writes a request's ``AccessRecord`` (``Job.record``)
and, once the request ended, its metrics and its access line.

The retry loop, the attempts and the continuation say what happened (an attempt began on a
worker, relayed its answer, the request failed or was ended from outside); the ``Recorder``
decides what that means for the record. Nothing is recorded while relaying: the metrics of a
request are written all at once, when it ended (``finish``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from app.accesslog import AccessLog, AccessRecord
from app.errors import GatewayError
from app.metrics import Metrics
from app.outcomes import Outcome
from app.proxy.continuation import ContinuedUsage
from app.proxy.job import Job
from app.proxy.unreported import unreported_usage
from app.routing.policies import Learns
from app.workers.acceptance import CollapseDetector
from app.workers.worker import Worker

if TYPE_CHECKING:
    from app.proxy.attempt import Attempt
    from app.proxy.dispatch import Target

log = logging.getLogger(__name__)


class Recorder:
    """Writes each request's record; one per ``Proxy``."""

    def __init__(
        self,
        *,
        metrics: Metrics,
        access_log: AccessLog,
        acceptance: CollapseDetector,
        clock: Callable[[], float],
        learns: Learns | None = None,
    ) -> None:
        """``learns``: the routing policy, when it learns from every answer (cache_aware)."""
        self._metrics = metrics
        self._learns = learns
        self._access = access_log
        self._clock = clock
        self.acceptance = acceptance

    @staticmethod
    def attempting(
        record: AccessRecord, number: int, worker: Worker, target: Target | None
    ) -> None:
        """Attempt ``number`` goes to ``worker`` (and its prefill worker, with PD)."""
        record.attempts = number
        record.worker = worker.name
        prefill = target.prefill if target is not None else None
        if prefill is not None:
            record.prefill_worker = prefill.name

    @staticmethod
    def relayed(record: AccessRecord, attempt: Attempt, stream: bool) -> None:
        """The attempt relayed the worker's answer (an in-band error event included)."""
        record.status = 200 if stream else attempt.status_code
        record.outcome = Outcome.UPSTREAM_ERROR if attempt.tally.inband_error else Outcome.OK

    @staticmethod
    def continued(record: AccessRecord, continuations: int) -> None:
        record.continuations = continuations

    @staticmethod
    def failed(record: AccessRecord, error: GatewayError, outcome: Outcome, started: bool) -> None:
        """The request gave up with ``error`` (its answer, or in-band once ``started``)."""
        record.outcome, record.error = outcome, error.message
        record.status = 200 if started else error.status

    @staticmethod
    def ended(record: AccessRecord, reason: Outcome, message: str | None, started: bool) -> None:
        """Ended from outside and hung up on: the client took nothing for too long
        (``message`` says how long), or the total deadline passed (``message`` the error)."""
        if reason is Outcome.CLIENT_TOO_SLOW:
            record.status, record.error = 499, message
        else:
            record.status, record.error = (200 if started else 504), message
        record.outcome = reason

    @staticmethod
    def shutdown(record: AccessRecord) -> None:
        record.outcome = Outcome.SHUTDOWN

    @staticmethod
    def broke(record: AccessRecord) -> None:
        """A bug in the gateway, not a worker failure."""
        record.outcome, record.status = Outcome.INTERNAL_ERROR, 500

    def finish(self, job: Job, disconnected: bool) -> None:
        """The request is over: what it relayed, its metrics (all at once), its access line."""
        record = job.record
        if disconnected and record.outcome is not Outcome.CLIENT_TOO_SLOW:
            record.outcome, record.status = Outcome.CLIENT_DISCONNECT, 499
        end = self._clock()
        record.duration_ms = round((end - job.started) * 1000, 3)
        self._note(job)
        try:
            self._record(job, end)
        except Exception:  # a bug in the metrics must not cost the access record too
            log.exception("request %s: metrics not recorded", job.request_id)
        finally:
            if self._learns is not None:
                self._learns.released(job.ctx)
        self._access.emit(record)

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
            return
        estimate = unreported_usage(job)
        if estimate is not None:  # what the key's quotas are charged, said to be an estimate
            record.prompt_tokens, record.completion_tokens = estimate
            record.usage_estimated = True

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
        (``app.proxy.continuation``); ``steps``: the verify steps of the whole stream."""
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
