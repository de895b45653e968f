"""``WorkerSeries``: each worker's series, from the moment it is known until it leaves the pool.

A worker's series are made when it is first seen (its attempts and violations by outcome and
kind, its gauges under its PD role, its token counters for every served model) and its gauges are
set from the pool when scraped (``observe``, through ``WorkerView``: what the scrape reads of a
``app.workers.worker.Worker``). A worker that changes role has its gauges moved under the new
one; a worker that leaves the pool has them removed (in multiprocess mode they are filtered out
when rendering, since a file's entries cannot be removed). The engine info gauge follows the
engine each worker reports.
"""

from __future__ import annotations

import contextlib
from typing import Protocol

from app.metrics.families import OTHER, VIOLATIONS, Families
from app.outcomes import ATTEMPT_OUTCOMES


class LoadView(Protocol):
    @property
    def gen_throughput(self) -> float: ...
    @property
    def running(self) -> int: ...
    @property
    def waiting(self) -> int: ...
    @property
    def waiting_tokens(self) -> int: ...
    @property
    def transfer_queue(self) -> int: ...
    @property
    def accept_length(self) -> float | None: ...
    @property
    def accept_rate(self) -> float | None: ...


class AcceptView(Protocol):
    @property
    def ewma(self) -> float | None: ...
    @property
    def collapsed(self) -> bool: ...


class BreakerView(Protocol):
    @property
    def state(self) -> int: ...


class WorkerView(Protocol):
    """What the scrape reads of a ``app.workers.worker.Worker``."""

    @property
    def name(self) -> str: ...
    @property
    def models(self) -> tuple[str, ...]: ...
    @property
    def in_flight(self) -> int: ...
    @property
    def up(self) -> bool: ...
    @property
    def load(self) -> LoadView: ...
    @property
    def breaker(self) -> BreakerView: ...
    @property
    def accept(self) -> AcceptView: ...
    @property
    def engine_name(self) -> str: ...
    @property
    def role(self) -> str: ...


class WorkerSeries:
    """The known workers (``names``) and their series. ``models``: the model label values in
    use, shared with ``Metrics`` (each worker has token counters for every one but ``other``)."""

    def __init__(self, families: Families, models: set[str], *, multiprocess: bool) -> None:
        self._f = families
        self._models = models
        self._multiprocess = multiprocess
        self.names: set[str] = set()
        self._roles: dict[str, str] = {}  # each worker's role label (whole, prefill, decode)
        self._engines: dict[str, str] = {}  # the engine label each worker's info gauge has

    def add(self, worker: str, role: str | None = None) -> None:
        """Make a worker's series; ``role``: its PD role (whole, prefill, decode; kept from the
        last call when None)."""
        if role is not None and self._roles.get(worker, role) != role:
            self._forget(worker)  # its role changed: its series go under the new one
        if worker in self.names:
            return
        f = self._f
        role = self._roles[worker] = role or self._roles.get(worker, "whole")
        self.names.add(worker)
        for outcome in ATTEMPT_OUTCOMES:
            f.upstream_attempts.labels(worker, outcome)
        for kind in VIOLATIONS:
            f.upstream_violations.labels(worker, kind)
        for gauge in (
            f.in_flight,
            f.worker_up,
            f.worker_breaker,
            f.worker_throughput,
            f.worker_collapsed,
        ):
            gauge.labels(worker, role)
        for model in self._models - {OTHER}:
            self._tokens(model, worker)

    def add_model(self, model: str) -> None:
        """Make ``model``'s token counters on every known worker."""
        for worker in self.names:
            self._tokens(model, worker)

    def _tokens(self, model: str, worker: str) -> None:
        f = self._f
        for counter in (
            f.prompt_tokens,
            f.cached_prompt_tokens,
            f.completion_tokens,
            f.reasoning_tokens,
            f.verify_steps,
        ):
            counter.labels(model, worker)

    def observe(self, w: WorkerView) -> None:
        """Set a worker's gauges from what it shows now (its series made if it is new)."""
        f = self._f
        name, role = w.name, w.role
        self.add(name, role)
        f.in_flight.labels(name, role).set(w.in_flight)
        f.worker_up.labels(name, role).set(1 if w.up else 0)
        f.worker_breaker.labels(name, role).set(int(w.breaker.state))
        engine = w.engine_name
        was = self._engines.get(name)
        if was != engine:
            if was is not None:
                with contextlib.suppress(KeyError):
                    f.worker_engine.remove(name, role, was)
            self._engines[name] = engine
            f.worker_engine.labels(name, role, engine).set(1)
        load = w.load
        f.worker_throughput.labels(name, role).set(load.gen_throughput)
        f.worker_running.labels(name, role).set(load.running)
        f.worker_waiting.labels(name, role).set(load.waiting)
        f.worker_queued_prefill_tokens.labels(name, role).set(load.waiting_tokens)
        if role != "whole":  # whole workers have no disaggregation queues
            f.worker_transfer_queue.labels(name, role).set(load.transfer_queue)
        if load.accept_length is not None:
            f.worker_accept_length.labels(name, role).set(load.accept_length)
        if load.accept_rate is not None:
            f.worker_accept_rate.labels(name, role).set(load.accept_rate)
        accept = w.accept
        f.worker_collapsed.labels(name, role).set(1 if accept.collapsed else 0)
        if accept.ewma is not None:
            f.worker_measured_accept.labels(name, role).set(accept.ewma)

    def keep_only(self, current: set[str]) -> None:
        """The pool is ``current``: every other worker's gauges go."""
        for gone in self.names - current:
            self._forget(gone)

    def _forget(self, worker: str) -> None:
        f = self._f
        self.names.discard(worker)
        role = self._roles.pop(worker, "whole")
        engine = self._engines.pop(worker, None)
        if engine is not None and not self._multiprocess:
            with contextlib.suppress(KeyError):
                f.worker_engine.remove(worker, role, engine)
        for gauge in (
            f.in_flight,
            f.worker_up,
            f.worker_breaker,
            f.worker_throughput,
            f.worker_accept_length,
            f.worker_accept_rate,
            f.worker_measured_accept,
            f.worker_collapsed,
            f.worker_running,
            f.worker_waiting,
            f.worker_queued_prefill_tokens,
            f.worker_transfer_queue,
        ):
            if self._multiprocess:
                if gauge is f.in_flight:
                    gauge.labels(worker, role).set(0)
                continue
            with contextlib.suppress(KeyError):
                gauge.remove(worker, role)
