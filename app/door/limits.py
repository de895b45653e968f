"""The key's limits and token quotas at the door: ``KeyLimits``, the check and its lease (what an
answer whose worker reported no usage is charged: ``app.proxy.unreported``)."""

from __future__ import annotations

import logging
from collections.abc import Awaitable
from typing import Any

from app.door.visit import Visit
from app.errors import RateLimited
from app.gateway import Gateway
from app.limits.per_key import Budget
from app.proxy.job import Job

log = logging.getLogger(__name__)


class KeyLimits:
    """The key's usage: the request counted for it, its token quotas checked
    (``app.tenants.quota``) and its limiter slot taken (``app.limits``): 429 + Retry-After when
    over a quota or a limit; a request refused by its quota still spends one of its key's
    requests, as OpenAI counts refused requests. The key's rate-limit headers, in the entry's
    style, go on every answer from here on, refusals included. The slot is a lease of its own
    (``_Slot``), given back once the response ended; then this check's lease counts the
    answer's tokens for the key and charges them to its quotas. Only in the list when keys are
    configured; it awaits nothing (no coroutine) when the key has neither limits nor quotas."""

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
            visit.response_headers += visit.entry.limit_headers(None, None)
            return None
        return self._admit(visit, key)

    async def _admit(self, visit: Visit, key: str) -> None:
        quota = self._quota
        state = await quota.check(key, visit.tenant.policy) if quota is not None else None
        tokens = state.tokens if state is not None else None
        requests: Budget | None = None
        style = visit.entry.limit_headers
        try:
            if self._limiter is not None:
                slot = self._limiter.hold(key)
                requests = await slot.__aenter__()
                visit.hold(_Slot(slot))
            refusal = state.refusal if state is not None else None
            if refusal is not None:
                self._metrics.record_quota_rejection(key, refusal.quota)
                raise RateLimited(refusal.message, retry_after=refusal.retry_after)
        except RateLimited as refused:
            budget = requests if refused.budget is None else refused.budget
            visit.response_headers += style(budget, tokens)
            raise
        visit.response_headers += style(requests, tokens)

    def release(self, visit: Visit, job: Job | None) -> Awaitable[None] | None:
        """Count the answer's tokens for the key; charge them to its quotas (after the slot,
        held later, was given back)."""
        key = visit.key
        if key is None or job is None:
            return None
        record = job.record
        if not record.usage_estimated and (record.prompt_tokens or record.completion_tokens):
            self._metrics.record_key_tokens(
                key,
                prompt=record.prompt_tokens or 0,
                completion=record.completion_tokens or 0,
                reasoning=record.reasoning_tokens or 0,
            )
        quota = self._quota
        if quota is None:
            return None
        # The worker's usage, or the estimate (``usage_estimated``).
        spent = (record.prompt_tokens or 0) + (record.completion_tokens or 0)
        return quota.charge(key, job.tenant.policy, spent)


class _Slot:
    """The key's limiter slot, held for the response's lifetime."""

    __slots__ = ("_slot",)

    def __init__(self, slot: Any) -> None:
        self._slot = slot

    async def release(self, visit: Visit, job: Job | None) -> None:
        try:
            await self._slot.__aexit__(None, None, None)
        except Exception:  # a limiter that fails to release must not fail the request
            log.exception("releasing a per-key limit failed")
