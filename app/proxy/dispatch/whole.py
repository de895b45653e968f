"""Whole workers: each attempt goes to one worker, picked by the routing policy, which answers it
whole. The dispatch is its own ``Target`` (an attempt needs nothing of its own to be sent)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from app.proxy.dispatch import Headers, Job, Pieces, continues_on
from app.routing.policies import Policy, RoutingContext
from app.workers.pool import WorkerPool
from app.workers.worker import Worker

if TYPE_CHECKING:
    from app.proxy.attempt import Attempt


class WholeWorkers:
    """The ``Dispatch`` of a fleet of whole workers (``worker_urls``, discovery)."""

    prefill: Worker | None = None  # no attempt's prompt is computed elsewhere

    def __init__(self, pool: WorkerPool, policy: Policy) -> None:
        self._pool = pool
        self._policy = policy

    def candidates(self, model: str, tried: set[str], *, continuing: bool = False) -> list[Worker]:
        """Not tried yet; SGLang ones for a continuation."""
        return [
            w
            for w in self._pool.available(model)
            if w.name not in tried and (not continuing or continues_on(w))
        ]

    def has_other(self, model: str, tried: set[str]) -> bool:
        return any(w.name not in tried for w in self._pool.available(model))

    def can_continue(self, model: str, tried: set[str]) -> bool:
        return any(w.name not in tried and continues_on(w) for w in self._pool.available(model))

    def pick(self, ctx: RoutingContext, candidates: list[Worker]) -> Worker:
        return self._policy.pick(ctx, candidates)

    def target(self, job: Job, worker: Worker, tried: set[str]) -> WholeWorkers:
        return self

    def outgoing(self, attempt: Attempt, path: str, body: Pieces, headers: Headers) -> Pieces:
        return body

    def close(self, attempt: Attempt) -> None:
        pass

    def blame(self, tried: set[str], worker: Worker) -> None:
        pass  # the attempt's worker is in ``tried`` already

    async def aclose(self) -> None:
        pass
