"""The key's limits and token quotas at the door: ``KeyLimits``, the check and its lease, and
``unreported_tokens``, what an answer whose worker reported no usage is charged."""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable

from app.door.visit import Visit
from app.errors import RateLimited
from app.gateway import Gateway
from app.limits import Budget
from app.outcomes import Outcome
from app.proxy.job import Job
from app.proxy.request import Route

log = logging.getLogger(__name__)


class KeyLimits:
    """The key's usage: the request counted for it, its token quotas checked
    (``app.tenants.quota``) and its limiter slot taken (``app.limits``): 429 + Retry-After when
    over a quota or a limit; a request refused by its quota still spends one of its key's
    requests, as OpenAI counts refused requests. The key's rate-limit headers, in the entry's
    style, go on every answer from here on, refusals included. The lease gives the slot back
    once the response ended, then counts the answer's tokens for the key and charges them to
    its quotas. Only in the list when keys are configured; it awaits nothing (no coroutine)
    when the key has neither limits nor quotas."""

    def __init__(self, gw: Gateway) -> None:
        self._metrics = gw.metrics
        self._quota = gw.quota
        self._limiter = gw.limiter

    def check(self, visit: Visit) -> Awaitable[None] | None:
        key = visit.key
        if key is None:
            return None
        self._metrics.record_key_request(key)
        visit.hold(self)
        if self._quota is None and self._limiter is None:
            visit.limit_headers += visit.entry.limit_headers(None, None)
            return None
        return self._admit(visit, key)

    async def _admit(self, visit: Visit, key: str) -> None:
        assert visit.tenant is not None
        quota = self._quota
        state = await quota.check(key, visit.tenant.policy) if quota is not None else None
        tokens = state.tokens if state is not None else None
        requests: Budget | None = None
        style = visit.entry.limit_headers
        try:
            if self._limiter is not None:
                slot = self._limiter.hold(key)
                requests = await slot.__aenter__()
                visit.slot = slot
            refusal = state.refusal if state is not None else None
            if refusal is not None:
                self._metrics.record_quota_rejection(key, refusal.quota)
                raise RateLimited(refusal.message, retry_after=refusal.retry_after)
        except RateLimited as refused:
            budget = requests if refused.budget is None else refused.budget
            visit.limit_headers += style(budget, tokens)
            raise
        visit.limit_headers += style(requests, tokens)

    def release(self, visit: Visit) -> Awaitable[None] | None:
        key, job = visit.key, visit.job
        if key is not None and job is not None:
            record = job.record
            if record.prompt_tokens or record.completion_tokens:
                self._metrics.record_key_tokens(
                    key,
                    prompt=record.prompt_tokens or 0,
                    completion=record.completion_tokens or 0,
                    reasoning=record.reasoning_tokens or 0,
                )
        if visit.slot is None and (self._quota is None or job is None):
            return None
        return self._give_back(visit)

    async def _give_back(self, visit: Visit) -> None:
        """The limiter slot, then the answer's tokens charged to the key's quotas."""
        slot, key, job = visit.slot, visit.key, visit.job
        if slot is not None:
            visit.slot = None
            try:
                await slot.__aexit__(None, None, None)
            except Exception:  # a limiter that fails to release must not fail the request
                log.exception("releasing a per-key limit failed")
        if self._quota is not None and key is not None and job is not None:
            record = job.record
            spent = (record.prompt_tokens or 0) + (record.completion_tokens or 0)
            await self._quota.charge(key, job.tenant.policy, spent or unreported_tokens(job))


# Decode speed of one request when its worker reported none (tokens per second): about what one
# request of a busy DFlash Kimi-K2.5 node generates (and the emulator at --speed 1).
NOMINAL_TOKENS_PER_S = 250.0


def unreported_tokens(job: Job) -> int:
    """An estimate of the prompt + completion tokens of a request whose worker reported no usage,
    so that neither cutting an answer short nor a worker that leaves ``usage`` out costs its key
    nothing. Prompt: the upstream body's bytes / 4. Completion, bounded by ``max_tokens`` per
    choice when the request has a bound:

    - a stream that relayed data events (its client hung up, its worker died, or it never sent
      its usage chunk): the events relayed (less a chat stream's role and finish events) times
      the worker's mean acceptance length (tokens per event, at least 1);
    - a whole answer that came without ``usage``: its bytes / 4;
    - a whole answer the client hung up on (or the total deadline ended once the answer began)
      while its worker was still at it (a worker sends a whole answer only once it is done):
      the time since it was sent times one request's decode speed on that worker as the worker
      last reported it (``gen_throughput / num_running_reqs`` from ``/v1/loads``;
      ``NOMINAL_TOKENS_PER_S`` when it reported none), for each choice: about what the worker
      generated until the gateway's abort reached it;
    - a stream the client hung up on before its first event: its prompt alone.

    0 when the usage is known, the request never reached a worker, or it failed there (an error
    status, a timeout, a dropped connection before any answer: the worker's fault, not spent on
    the client)."""
    attempt = job.attempt
    request = job.request
    if attempt is None or attempt.tally.usage is not None or request.route is Route.COUNT_TOKENS:
        return 0
    tally = attempt.tally
    if tally.first_at is not None:
        overhead = 2 * request.choices if request.route is Route.CHAT else 0
        per_event = max(1.0, attempt.worker.load.accept_length or 1.0)
        completion = max(0, tally.events - overhead) * per_event
    elif tally.answer_bytes:
        completion = tally.answer_bytes / 4
    elif attempt.written and attempt.reason is Outcome.CANCELLED:
        load = attempt.worker.load
        rate = load.gen_throughput / max(1, load.running) if load.gen_throughput > 0 else 0.0
        rate = rate if math.isfinite(rate) and rate > 0 else NOMINAL_TOKENS_PER_S
        elapsed = max(0.0, attempt.clock() - attempt.started)
        completion = 0.0 if request.stream else elapsed * rate * request.choices
    else:
        return 0
    if request.max_tokens is not None:
        completion = min(completion, request.max_tokens * request.choices)
    prompt = sum(len(part) for part in request.upstream_parts("")) // 4
    return prompt + math.ceil(completion)
