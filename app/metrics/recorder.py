"""``Metrics``: the label values of every family (bounded, pre-initialised so each series exists
from start-up), the ``record_*`` calls the proxy makes once per request, and the pool's gauges
read when scraped.

A request's updates are held until the next collect (``app.metrics.held``); each worker's series
are kept by ``WorkerSeries`` (``app.metrics.pool``)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, disable_created_metrics

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
    WORKER_GAUGES,
    Families,
)
from app.metrics.held import AtOnce, FlushFirst, Pending, Updates
from app.metrics.pool import WorkerSeries, WorkerView
from app.metrics.prom_adapter import multiprocess_mode, render, render_multiprocess
from app.outcomes import STREAM_OUTCOMES, Outcome
from app.tenants.config import PRIORITIES

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
        updates: Updates = AtOnce() if self.multiprocess else Pending()
        self._updates = updates
        self._inc, self._observe = updates.inc, updates.observe
        self._observe_gaps = updates.observe_gaps
        registry = registry or CollectorRegistry(auto_describe=True)
        registry.register(FlushFirst(updates.flush))
        super().__init__(registry)
        self._clock = clock
        self._models: set[str] = set()
        self._workers = WorkerSeries(self, self._models, multiprocess=self.multiprocess)
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
        self._workers.add_model(model)
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

    def add_worker(self, worker: str, role: str | None = None) -> None:
        """Pre-initialise a worker's series so they exist from start-up; ``role``: its PD role
        (whole, prefill, decode; kept from the last call when None)."""
        self._workers.add(worker, role)

    def add_key(self, name: str) -> None:
        """Pre-initialise a configured API key name's series."""
        self.key_requests.labels(name)
        self.key_completion_tokens.labels(name)
        self.key_prompt_tokens.labels(name)
        self.key_reasoning_tokens.labels(name)
        for quota in QUOTAS:
            self.quota_rejections.labels(name, quota)

    # -- once per request ---------------------------------------------------------------------

    def flush(self) -> None:
        """Add the held updates to their series (done by every collect)."""
        self._updates.flush()

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
        if series is None or worker not in self._workers.names:
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
            current.add(w.name)
            self._workers.observe(w)
            for model in w.models:
                self._model(model)
        self._workers.keep_only(current)
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
        return render_multiprocess(WORKER_GAUGES, set(self._workers.names))
