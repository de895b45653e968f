"""``Metrics``: the label values of every family (bounded, pre-initialised so each series exists
from start-up), the ``record_*`` calls the proxy makes once per request, and the pool's gauges
read when scraped.

A request's counter increments and histogram observations are held in plain Python (a sum per
counter series, bucket counts and a sum per histogram series: bounded by the series, not the
requests) and added to prometheus_client's series at the next collect (a scrape, or any
``registry.collect``/``get_sample_value``): a request pays a dict update where
prometheus_client takes a lock and runs its checks per call, and a histogram's bucket is found
by one ``bisect`` rather than a scan of its bounds. In multiprocess mode (``--processes N``),
where another process reads this one's files, every update goes to the files at once."""

from __future__ import annotations

import asyncio
import contextlib
import time
from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, disable_created_metrics
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from app.metrics.families import (
    BACKGROUND_TASKS,
    CONTINUATION_OUTCOMES,
    LIMIT_STORES,
    MAX_MODELS,
    OTHER,
    QUOTAS,
    RETRY_REASONS,
    SOURCES,
    STATUSES,
    THROUGHPUT_WINDOW_S,
    VIOLATIONS,
    WORKER_GAUGES,
    Families,
)
from app.metrics.prom_adapter import (
    add_counts,
    multiprocess_mode,
    observe_gaps,
    render,
    render_multiprocess,
    upper_bounds,
)
from app.outcomes import ATTEMPT_OUTCOMES, STREAM_OUTCOMES, Outcome
from app.tenants.config import PRIORITIES


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


_SERIES_CACHE = 4096  # label tuples kept by ``record_request``/``record_tokens``


class TokenWindow:
    """Completion tokens per second over the last ``window_s`` whole seconds (plus the current)."""

    __slots__ = ("_counts", "_seconds", "_window")

    def __init__(self, window_s: int = THROUGHPUT_WINDOW_S) -> None:
        self._window = window_s
        self._seconds = [-1] * (window_s + 1)
        self._counts = [0] * (window_s + 1)

    def add(self, now: float, tokens: int) -> None:
        second = int(now)
        slot = second % len(self._seconds)
        if self._seconds[slot] != second:
            self._seconds[slot] = second
            self._counts[slot] = 0
        self._counts[slot] += tokens

    def rate(self, now: float) -> float:
        oldest = int(now) - self._window
        total = sum(c for s, c in zip(self._seconds, self._counts, strict=True) if s >= oldest)
        return total / self._window


class _Held:
    """A histogram series' observations not yet added to it: bucket counts and their sum."""

    __slots__ = ("bounds", "counts", "total")

    def __init__(self, bounds: list[float]) -> None:
        self.bounds = bounds
        self.counts = [0] * len(bounds)
        self.total = 0.0


class _Flush(Collector):
    """Registered on the registry before the families: every collect adds what is held first."""

    def __init__(self, flush: Callable[[], None]) -> None:
        self._flush = flush

    def describe(self) -> Iterator[Metric]:
        return iter(())

    def collect(self) -> Iterator[Metric]:
        self._flush()
        return iter(())


class Metrics(Families):
    """The families with their label values, recorded into once per request and refreshed from
    the pool when scraped."""

    def __init__(
        self,
        *,
        models: Iterable[str] = (),
        routes: Iterable[str] = (),
        registry: CollectorRegistry | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``routes``: the API routes whose series exist from start-up (the surface registry's,
        ``app.surfaces.ROUTES``; a route label is a path the gateway serves, never a client's)."""
        # No ``*_created`` series: they would double the series count (and multiprocess mode has
        # none), and Prometheus 2.x does not use them.
        disable_created_metrics()  # type: ignore[no-untyped-call]
        self.multiprocess = multiprocess_mode()
        # The updates held until the next collect (see the module doc).
        self._counts: dict[Any, float] = {}
        self._held: dict[Any, _Held] = {}
        if self.multiprocess:
            self._inc, self._observe = _inc_now, _observe_now  # type: ignore[method-assign]
        registry = registry or CollectorRegistry(auto_describe=True)
        registry.register(_Flush(self.flush))
        super().__init__(registry)
        self._clock = clock
        self._models: set[str] = set()
        self._workers: set[str] = set()
        self._engines: dict[str, str] = {}  # the engine label each worker's info gauge has
        self._roles: dict[str, str] = {}  # each worker's role label (whole, prefill, decode)
        self._windows: dict[str, TokenWindow] = {}
        self._children: dict[tuple[Any, tuple[str, ...]], Any] = {}
        # A request's series by its labels, looked up in one step (``_series``).
        self._request_series: dict[tuple[str, str, int], tuple[Any, Any]] = {}
        self._token_series: dict[tuple[str, str], tuple[str, Any, Any, Any, Any]] = {}
        self._routes = tuple(routes)

        for outcome in STREAM_OUTCOMES:
            self.stream_outcomes.labels(outcome)
        for route in self._routes:
            self.dropped_fields.labels(route)
        for priority in PRIORITIES:
            self.queue_wait.labels(priority)
        for limit in LIMIT_STORES:
            self.limit_store_errors.labels(limit)
        for task in BACKGROUND_TASKS:
            self.background_restarts.labels(task)
        for reason in (*sorted(RETRY_REASONS), OTHER):
            self.retries.labels(reason)
        for label in CONTINUATION_OUTCOMES:
            self.stream_continuations.labels(label)
        self._model(OTHER)
        for model in models:
            self._model(model)

    # -- label sets ---------------------------------------------------------------------------

    def _model(self, model: str) -> str:
        """The model's label value, pre-initialising its series the first time it is seen."""
        if model in self._models:
            return model
        if len(self._models) > MAX_MODELS:  # OTHER + MAX_MODELS served models
            return OTHER
        self._models.add(model)
        for route in self._routes:
            for status in STATUSES:
                self.requests.labels(route, model, status)
            self.request_duration.labels(route, model)
        if model == OTHER:
            return model
        for histogram in (self.ttft, self.inter_chunk, self.tpot):
            histogram.labels(model)
        for source in SOURCES:
            self.accept_length.labels(model, source)
        self.throughput.labels(model)
        self._windows[model] = TokenWindow()
        for worker in self._workers:
            self._model_worker(model, worker)
        return model

    def _child(self, metric: Any, *labels: str) -> Any:
        """``metric.labels(*labels)``, looked up once: prometheus_client's ``labels`` takes a
        lock and rebuilds the label tuple on every call, and a request records a dozen series.
        (Only for series never removed: counters and histograms.)"""
        key = (metric, labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def _model_worker(self, model: str, worker: str) -> None:
        for counter in (
            self.prompt_tokens,
            self.cached_prompt_tokens,
            self.completion_tokens,
            self.reasoning_tokens,
            self.verify_steps,
        ):
            counter.labels(model, worker)

    def add_worker(self, worker: str, role: str | None = None) -> None:
        """Pre-initialise a worker's series so they exist from start-up; ``role``: its PD role
        (whole, prefill, decode; kept from the last call when None)."""
        if role is not None and self._roles.get(worker, role) != role:
            self._forget_worker(worker)  # its role changed: its series go under the new one
        if worker in self._workers:
            return
        role = self._roles[worker] = role or self._roles.get(worker, "whole")
        self._workers.add(worker)
        for outcome in ATTEMPT_OUTCOMES:
            self.upstream_attempts.labels(worker, outcome)
        for kind in VIOLATIONS:
            self.upstream_violations.labels(worker, kind)
        for gauge in (
            self.in_flight,
            self.worker_up,
            self.worker_breaker,
            self.worker_throughput,
            self.worker_collapsed,
        ):
            gauge.labels(worker, role)
        for model in self._models - {OTHER}:
            self._model_worker(model, worker)

    def _forget_worker(self, worker: str) -> None:
        """A worker left the pool: its gauges go (in multiprocess mode they are filtered out when
        rendering, since a file's entries cannot be removed)."""
        self._workers.discard(worker)
        role = self._roles.pop(worker, "whole")
        engine = self._engines.pop(worker, None)
        if engine is not None and not self.multiprocess:
            with contextlib.suppress(KeyError):
                self.worker_engine.remove(worker, role, engine)
        for gauge in (
            self.in_flight,
            self.worker_up,
            self.worker_breaker,
            self.worker_throughput,
            self.worker_accept_length,
            self.worker_accept_rate,
            self.worker_measured_accept,
            self.worker_collapsed,
            self.worker_running,
            self.worker_waiting,
            self.worker_queued_prefill_tokens,
            self.worker_transfer_queue,
        ):
            if self.multiprocess:
                if gauge is self.in_flight:
                    gauge.labels(worker, role).set(0)
                continue
            with contextlib.suppress(KeyError):
                gauge.remove(worker, role)

    def add_key(self, name: str) -> None:
        """Pre-initialise a configured API key name's series."""
        self.key_requests.labels(name)
        self.key_completion_tokens.labels(name)
        self.key_prompt_tokens.labels(name)
        self.key_reasoning_tokens.labels(name)
        for quota in QUOTAS:
            self.quota_rejections.labels(name, quota)

    # -- once per request ---------------------------------------------------------------------

    def _inc(self, child: Any, amount: float = 1) -> None:
        """``child.inc(amount)`` at the next collect."""
        if amount < 0:
            raise ValueError("counters can only be incremented by non-negative amounts")
        counts = self._counts
        counts[child] = counts.get(child, 0) + amount

    def _observe(self, child: Any, value: float) -> None:
        """``child.observe(value)`` at the next collect."""
        held = self._held.get(child)
        if held is None:
            held = self._held[child] = _Held(upper_bounds(child))
        held.counts[bisect_left(held.bounds, value)] += 1
        held.total += value

    def flush(self) -> None:
        """Add the held updates to their series (done by every collect)."""
        counts, self._counts = self._counts, {}
        held, self._held = self._held, {}
        for child, amount in counts.items():
            child.inc(amount)
        for child, h in held.items():
            add_counts(child, h.counts, h.total)

    def record_dropped_fields(self, route: str) -> None:
        self._inc(self._child(self.dropped_fields, route))

    def record_request(
        self, route: str, model: str, status: int, duration_s: float | None = None
    ) -> None:
        key = (route, model, status)
        series = self._request_series.get(key)
        if series is None:
            label = self._model(model)
            code = str(status) if 100 <= status <= 599 else OTHER
            series = self._requests_series(key)[key] = (
                self._child(self.requests, route, label, code),
                self._child(self.request_duration, route, label),
            )
        self._inc(series[0])
        if duration_s is not None:
            self._observe(series[1], duration_s)

    def _requests_series(self, key: tuple[str, str, int]) -> dict[tuple[str, str, int], Any]:
        """The request series cache, emptied if clients' values would make it grow unbounded
        (the labels themselves are bounded: ``_model``)."""
        if len(self._request_series) > _SERIES_CACHE:
            self._request_series.clear()
        return self._request_series

    def record_tokens(
        self,
        model: str,
        worker: str,
        *,
        prompt: int | None,
        completion: int | None,
        reasoning: int | None,
        verify_steps: int | None,
        source: str | None,
        cached: int | None = None,
    ) -> None:
        """One request's token counts and verify steps (None: not known). ``source``: the
        per-request acceptance length is ``exact`` or ``estimated``; None: only the worker's mean
        was known (the steps count, the per-request histogram does not). ``cached``: of
        ``prompt``, the tokens from the worker's prefix cache."""
        series = self._token_series.get((model, worker))
        if series is None or worker not in self._workers:
            series = self._tokens_of(model, worker)
        label, prompt_series, reasoning_series, completion_series, steps_series = series
        if prompt:
            self._inc(prompt_series, prompt)
            if cached:
                hits = self._child(self.cached_prompt_tokens, label, worker)
                self._inc(hits, min(cached, prompt))
        if reasoning:
            self._inc(reasoning_series, reasoning)
        if not completion:
            return
        self._inc(completion_series, completion)
        window = self._windows.get(label)
        if window is not None:
            window.add(self._clock(), completion)
        if verify_steps:
            self._inc(steps_series, verify_steps)
            if source in SOURCES:
                accept = self._child(self.accept_length, label, source)
                self._observe(accept, completion / verify_steps)

    def _tokens_of(self, model: str, worker: str) -> tuple[str, Any, Any, Any, Any]:
        """The model's label and the token series of ``model`` on ``worker`` (cached)."""
        label = self._model(model)
        self.add_worker(worker)
        if len(self._token_series) > _SERIES_CACHE:
            self._token_series.clear()
        series = self._token_series[(model, worker)] = (
            label,
            self._child(self.prompt_tokens, label, worker),
            self._child(self.reasoning_tokens, label, worker),
            self._child(self.completion_tokens, label, worker),
            self._child(self.verify_steps, label, worker),
        )
        return series

    def record_stream_timing(
        self,
        model: str,
        *,
        ttft_s: float,
        first_at: float,
        chunk_times: Sequence[float],
        completion_tokens: int | None,
    ) -> None:
        """A committed stream: time to first token, the gaps between the chunks relayed after the
        first (``chunk_times``, clock readings), time per output token."""
        label = self._model(model)
        self._observe(self._child(self.ttft, label), ttft_s)
        if not chunk_times:
            return
        self._observe_gaps(self._child(self.inter_chunk, label), first_at, chunk_times)
        if completion_tokens and completion_tokens > 1:
            tpot = (chunk_times[-1] - first_at) / (completion_tokens - 1)
            self._observe(self._child(self.tpot, label), tpot)

    def _observe_gaps(self, child: Any, first_at: float, times: Sequence[float]) -> None:
        """``_observe(gap)`` for every gap between consecutive clock readings, in one pass."""
        if self.multiprocess:
            observe_gaps(child, first_at, times)
            return
        held = self._held.get(child)
        if held is None:
            held = self._held[child] = _Held(upper_bounds(child))
        bounds, counts = held.bounds, held.counts
        previous = first_at
        for at in times:
            counts[bisect_left(bounds, at - previous)] += 1
            previous = at
        held.total += times[-1] - first_at

    def record_queue_wait(self, seconds: float, priority: str) -> None:
        self._observe(self._child(self.queue_wait, priority), seconds)

    def record_kv_wait(self, model: str, seconds: float) -> None:
        """A PD pair's KV-transfer wait (``app.proxy.dispatch.pd``)."""
        self._child(self.kv_transfer_wait, self._model(model)).observe(seconds)

    def record_attempt(self, worker: str, outcome: Outcome) -> None:
        self._inc(self._child(self.upstream_attempts, worker, outcome))

    def record_kv_events(
        self,
        worker: str,
        *,
        stored: tuple[int, int] = (0, 0),
        removed: tuple[int, int] = (0, 0),
        clears: int = 0,
        gap: bool = False,
    ) -> None:
        """One batch of a worker's KV events: (blocks, tokens) stored and removed."""
        for kind, (blocks, tokens) in (("stored", stored), ("removed", removed)):
            if blocks:
                self._inc(self._child(self.kv_event_blocks, worker, kind), blocks)
            if tokens:
                self._inc(self._child(self.kv_event_tokens, worker, kind), tokens)
        if clears:
            self._inc(self._child(self.kv_event_clears, worker), clears)
        if gap:
            self._inc(self._child(self.kv_event_gaps, worker))

    def record_violation(self, worker: str, kind: str) -> None:
        """``kind``: one of ``VIOLATIONS``."""
        self._inc(self._child(self.upstream_violations, worker, kind))

    def record_retry(self, reason: str) -> None:
        self._inc(self._child(self.retries, reason if reason in RETRY_REASONS else OTHER))

    def record_routing_decision(self, policy: str, reason: str) -> None:
        """Why a request went to its worker (``app.routing.cache_aware.REASONS``)."""
        self._inc(self._child(self.routing_decisions, policy, reason))

    def record_continuation(self, outcome: str) -> None:
        """``outcome``: one of ``CONTINUATION_OUTCOMES``."""
        self._inc(self._child(self.stream_continuations, outcome))

    def record_abort(self) -> None:
        self.aborts_sent.inc()

    def record_stream(self, outcome: Outcome) -> None:
        outcomes = self.stream_outcomes
        self._inc(self._child(outcomes, outcome if outcome in STREAM_OUTCOMES else OTHER))

    def record_key_request(self, name: str) -> None:
        self._inc(self._child(self.key_requests, name))

    def record_key_tokens(self, name: str, *, prompt: int, completion: int, reasoning: int) -> None:
        if prompt:
            self._inc(self._child(self.key_prompt_tokens, name), prompt)
        if completion:
            self._inc(self._child(self.key_completion_tokens, name), completion)
        if reasoning:
            self._inc(self._child(self.key_reasoning_tokens, name), reasoning)

    def record_quota_rejection(self, name: str, quota: str) -> None:
        """``quota``: one of ``QUOTAS``."""
        self._inc(self._child(self.quota_rejections, name, quota))

    def record_limit_store_error(self, limit: str) -> None:
        """``limit``: one of ``LIMIT_STORES``."""
        self.limit_store_errors.labels(limit).inc()

    def record_client_write_timeout(self) -> None:
        self.client_write_timeouts.inc()

    def record_task_restart(self, task: str) -> None:
        """``task``: one of ``BACKGROUND_TASKS`` (``app.background.supervise``)."""
        self.background_restarts.labels(task if task in BACKGROUND_TASKS else OTHER).inc()

    def record_usage_log_dropped(self, lines: int = 1) -> None:
        self.usage_log_dropped.inc(lines)

    # -- when scraped -------------------------------------------------------------------------

    def observe_pool(
        self, workers: Iterable[WorkerView], queue_depth: int, saturation: float = 0.0
    ) -> None:
        """Worker-side gauges, queue depth, fleet saturation (``Admission.saturation``) and the
        gateway's tokens/s, from the pool now."""
        current: set[str] = set()
        for w in workers:
            name, role = w.name, w.role
            current.add(name)
            self.add_worker(name, role)
            for model in w.models:
                self._model(model)
            self.in_flight.labels(name, role).set(w.in_flight)
            self.worker_up.labels(name, role).set(1 if w.up else 0)
            self.worker_breaker.labels(name, role).set(int(w.breaker.state))
            engine = w.engine_name
            was = self._engines.get(name)
            if was != engine:
                if was is not None:
                    with contextlib.suppress(KeyError):
                        self.worker_engine.remove(name, role, was)
                self._engines[name] = engine
                self.worker_engine.labels(name, role, engine).set(1)
            load = w.load
            self.worker_throughput.labels(name, role).set(load.gen_throughput)
            self.worker_running.labels(name, role).set(load.running)
            self.worker_waiting.labels(name, role).set(load.waiting)
            self.worker_queued_prefill_tokens.labels(name, role).set(load.waiting_tokens)
            if role != "whole":  # whole workers have no disaggregation queues
                self.worker_transfer_queue.labels(name, role).set(load.transfer_queue)
            if load.accept_length is not None:
                self.worker_accept_length.labels(name, role).set(load.accept_length)
            if load.accept_rate is not None:
                self.worker_accept_rate.labels(name, role).set(load.accept_rate)
            accept = w.accept
            self.worker_collapsed.labels(name, role).set(1 if accept.collapsed else 0)
            if accept.ewma is not None:
                self.worker_measured_accept.labels(name, role).set(accept.ewma)
        for gone in self._workers - current:
            self._forget_worker(gone)
        self.queue_depth.set(queue_depth)
        self.fleet_saturation.set(saturation)
        now = self._clock()
        for model, window in self._windows.items():
            self.throughput.labels(model).set(window.rate(now))

    async def keep_fresh(
        self,
        workers: Callable[[], Iterable[WorkerView]],
        queue_depth: Callable[[], int],
        interval_s: float = 1.0,
        saturation: Callable[[], float] | None = None,
    ) -> None:
        """``observe_pool`` every ``interval_s`` until cancelled. In multiprocess mode a scrape is
        answered by one process, which reads the others' gauges from their files: they must
        keep them current themselves."""
        while True:
            self.flush()
            self.observe_pool(workers(), queue_depth(), saturation() if saturation else 0.0)
            await asyncio.sleep(interval_s)

    def render(self) -> bytes:
        """The exposition: this process's registry, or (multiprocess mode) every process's files
        merged, without the gauges of workers that left the pool."""
        if not self.multiprocess:
            return render(self.registry)
        return render_multiprocess(WORKER_GAUGES, set(self._workers))


def _inc_now(child: Any, amount: float = 1) -> None:
    child.inc(amount)


def _observe_now(child: Any, value: float) -> None:
    child.observe(value)
