"""WorkerPool: which workers exist, and which of them may take a request for a model now."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

from app.workers.breaker import CircuitBreaker
from app.workers.config import BreakerConfig
from app.workers.engines import split_engine_url
from app.workers.worker import Role, Worker, WorkerState


class EndpointLike(Protocol):
    """What a discovery source publishes per worker (``app.workers.discovery.Endpoint``)."""

    @property
    def name(self) -> str: ...

    @property
    def url(self) -> str: ...

    @property
    def draining(self) -> bool: ...


def _role(endpoint: EndpointLike) -> tuple[Role, int | None]:
    """An endpoint's PD role and bootstrap port (sources that know none publish whole workers)."""
    return getattr(endpoint, "role", "whole"), getattr(endpoint, "bootstrap_port", None)


class WorkerPool:
    def __init__(
        self,
        urls: Sequence[str] = (),
        *,
        breaker: BreakerConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._breaker = breaker or BreakerConfig()
        self._clock = clock
        self._workers: dict[str, Worker] = {}
        # The worker's own /v1/models entry per model id (max_model_len etc.), for /v1/models.
        self._cards: dict[str, dict[str, Any]] = {}
        for url in urls:
            worker = self._new_worker(url)
            self._workers[worker.name] = worker

    def _new_worker(
        self, url: str, name: str = "", role: Role = "whole", bootstrap_port: int | None = None
    ) -> Worker:
        breaker = CircuitBreaker(
            failure_threshold=self._breaker.failure_threshold,
            open_s=self._breaker.open_s,
            clock=self._clock,
        )
        return Worker(url, name=name, breaker=breaker, role=role, bootstrap_port=bootstrap_port)

    @property
    def workers(self) -> tuple[Worker, ...]:
        return tuple(self._workers.values())

    def get(self, name: str) -> Worker | None:
        return self._workers.get(name)

    def available(self, model: str) -> list[Worker]:
        """Healthy workers serving ``model`` (the candidates a policy picks from)."""
        return [w for w in self._workers.values() if w.routable and model in w.models]

    def available_as(self, model: str, role: Role) -> list[Worker]:
        """``available`` among the workers of one PD role (prefill or decode)."""
        return [
            w for w in self._workers.values() if w.role == role and w.routable and model in w.models
        ]

    def served_models(self) -> list[str]:
        """Every model a known worker has reported, in first-seen order."""
        seen: dict[str, None] = {}
        for worker in self._workers.values():
            for model in worker.models:
                seen.setdefault(model, None)
        return list(seen)

    def card(self, model: str) -> dict[str, Any]:
        return dict(self._cards.get(model) or {"id": model, "object": "model"})

    def set_models(self, worker: Worker, cards: Iterable[dict[str, Any]]) -> None:
        ids: list[str] = []
        for card in cards:
            model_id = card.get("id")
            if isinstance(model_id, str) and model_id:
                ids.append(model_id)
                self._cards.setdefault(model_id, card)
                length = card.get("max_model_len")
                if isinstance(length, int) and not isinstance(length, bool) and length > 0:
                    worker.context_length = length
        worker.models = tuple(ids)

    def reconcile(self, endpoints: Iterable[EndpointLike]) -> None:
        """Make membership match a discovery snapshot. A worker that disappears while it still has
        requests in flight stays (draining) until they finish; new workers start STARTING."""
        seen: set[str] = set()
        for endpoint in endpoints:
            seen.add(endpoint.name)
            worker = self._workers.get(endpoint.name)
            role, bootstrap_port = _role(endpoint)
            if (
                worker is None
                or worker.url != split_engine_url(endpoint.url)[1].rstrip("/")
                or worker.role != role
                or worker.bootstrap_port != bootstrap_port
            ):
                worker = self._new_worker(endpoint.url, endpoint.name, role, bootstrap_port)
                self._workers[endpoint.name] = worker
            if endpoint.draining:
                worker.state = WorkerState.DRAINING
            elif worker.state is WorkerState.DRAINING:
                worker.state = WorkerState.STARTING
        for name in list(self._workers):
            if name not in seen:
                worker = self._workers[name]
                if worker.in_flight:
                    worker.state = WorkerState.DRAINING
                else:
                    del self._workers[name]
