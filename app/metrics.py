"""Every Prometheus object the gateway exports (CONTRACTS.md, "Metrics"), on a registry owned by
the app (no globals), and the ``record_*`` helpers the proxy calls once per request.

Label values are bounded and server-controlled: ``route`` from a fixed set; ``model`` = a served
model (aliases resolved; at most ``MAX_MODELS``, else ``other``); ``worker`` = the worker's stable
name; ``status`` = the HTTP status sent; ``key`` = a configured API key name; ``reason`` and
``outcome`` from fixed sets. Bounded label sets are pre-initialised, so every series exists from
start-up (a worker's and a model's as soon as they are known).

Acceptance length: ``spec_accept_length{source}`` is one observation per request,
``exact`` (the worker's ``meta_info``) or ``estimated`` (chunks of a stream; see
``app.upstream.sse``). ``completion_tokens_total / spec_verify_steps_total`` is the token-weighted
fleet figure; the histogram's ``_sum / _count`` is the unweighted per-request mean (the seed
card's estimator).

Worker-side gauges (up, breaker, in flight, the worker's own ``/v1/loads`` figures) and the queue
depth are read from the pool when scraped (``observe_pool``). With ``--processes N`` every process
writes its own files (prometheus_client's multiprocess mode, chosen by ``PROMETHEUS_MULTIPROC_DIR``
before the library is imported) and ``render`` merges them: counters and histograms add up,
in-flight, queue depth and the gateway's tokens/s add up over live processes (``livesum``), worker
figures take the largest (``livemax``: up, breaker state) or the latest value (``livemostrecent``).
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Literal, Protocol

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client import values as prometheus_values
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.metrics_core import Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

PREFIX = "dflash_gateway_"
CONTENT_TYPE = CONTENT_TYPE_LATEST
OTHER = "other"
ROUTES = ("/v1/chat/completions", "/v1/completions")
MAX_MODELS = 32
# requests_total series that exist before the first such answer (alerts divide by them).
STATUSES = ("200", "400", "404", "429", "499", "500", "502", "503", "504")
STREAM_OUTCOMES = (
    "ok",
    "client_disconnect",
    "upstream_error",
    "upstream_timeout",
    "stream_broken",
    "no_worker",
    "no_capacity",
    "shutdown",
    "internal_error",
)
ATTEMPT_OUTCOMES = ("ok", "connect_error", "status_error", "timeout", "broken", "cancelled")
# ``retries_total{reason}``: the error code of the failed attempt.
RETRY_REASONS = frozenset(
    {"upstream_unavailable", "stream_interrupted", "upstream_timeout", "502", "503", "504"}
)
SOURCES = ("exact", "estimated")

# Accept lengths are 1..8 (block size 8): quarter steps. TTFT covers minutes of prefill/queueing.
ACCEPT_LENGTH_BUCKETS = tuple(1 + 0.25 * i for i in range(29))
TTFT_BUCKETS = (
    0.05, 0.1, 0.25, 0.5, 0.75, 1, 1.5, 2, 3, 5, 7.5, 10, 15, 20, 30, 45, 60, 90, 120, 180, 240,
    300, 600,
)  # fmt: skip
INTER_CHUNK_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.06, 0.075, 0.1, 0.125, 0.15, 0.2, 0.3,
    0.5, 0.75, 1, 2, 5, 10, 30,
)  # fmt: skip
TPOT_BUCKETS = (
    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.0125, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1,
    0.15, 0.2, 0.3, 0.5, 1, 2.5,
)  # fmt: skip
DURATION_BUCKETS = (
    0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 45, 60, 90, 120, 180, 300, 600, 900, 1800, 3600,
)  # fmt: skip
QUEUE_BUCKETS = (
    0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120,
)  # fmt: skip
THROUGHPUT_WINDOW_S = 10
GaugeMode = Literal["livesum", "livemax", "livemostrecent"]
# Gauges whose worker label must match a current pool member (see ``_CurrentWorkers``).
_WORKER_GAUGES = frozenset(
    PREFIX + name
    for name in (
        "in_flight_requests",
        "worker_up",
        "worker_breaker_state",
        "worker_spec_accept_length",
        "worker_spec_accept_rate",
        "worker_output_throughput_tokens_per_second",
    )
)


class LoadView(Protocol):
    @property
    def gen_throughput(self) -> float: ...
    @property
    def accept_length(self) -> float | None: ...
    @property
    def accept_rate(self) -> float | None: ...


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


def multiprocess_mode() -> bool:
    """prometheus_client writes to ``PROMETHEUS_MULTIPROC_DIR`` (set before it was imported)."""
    return bool(getattr(prometheus_values.ValueClass, "_multiprocess", False))


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


class Metrics:
    def __init__(
        self,
        *,
        models: Iterable[str] = (),
        registry: CollectorRegistry | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        # No ``*_created`` series: they would double the series count (and multiprocess mode has
        # none), and Prometheus 2.x does not use them.
        disable_created_metrics()  # type: ignore[no-untyped-call]
        self.multiprocess = multiprocess_mode()
        self.registry = registry or CollectorRegistry(auto_describe=True)
        self._clock = clock
        self._models: set[str] = set()
        self._workers: set[str] = set()
        self._windows: dict[str, TokenWindow] = {}
        self._children: dict[tuple[Any, tuple[str, ...]], Any] = {}
        r = self.registry

        def counter(name: str, doc: str, labels: Sequence[str] = ()) -> Counter:
            return Counter(PREFIX + name, doc, labels, registry=r)

        def histogram(
            name: str, doc: str, labels: Sequence[str], buckets: Sequence[float]
        ) -> Histogram:
            return Histogram(PREFIX + name, doc, labels, registry=r, buckets=buckets)

        def gauge(name: str, doc: str, labels: Sequence[str], mode: GaugeMode) -> Gauge:
            return Gauge(PREFIX + name, doc, labels, registry=r, multiprocess_mode=mode)

        # Traffic.
        self.requests = counter(
            "requests", "Client requests answered, by HTTP status", ("route", "model", "status")
        )
        self.request_duration = histogram(
            "request_duration_seconds",
            "Time from the request's arrival to its last byte",
            ("route", "model"),
            DURATION_BUCKETS,
        )
        self.stream_outcomes = counter("stream_outcomes", "How streams ended", ("outcome",))
        self.upstream_attempts = counter(
            "upstream_attempts", "Requests sent to workers, by outcome", ("worker", "outcome")
        )
        self.retries = counter("retries", "Attempts retried on another worker", ("reason",))
        self.aborts_sent = counter("aborts_sent", "POST /abort_request calls sent to workers")
        self.queue_wait = histogram(
            "queue_wait_seconds",
            "Time a request waited for a worker with capacity (admission queue)",
            (),
            QUEUE_BUCKETS,
        )
        # Latency of streams.
        self.ttft = histogram(
            "time_to_first_token_seconds",
            "Time from the request's arrival to its first data event relayed (streams)",
            ("model",),
            TTFT_BUCKETS,
        )
        self.inter_chunk = histogram(
            "inter_chunk_seconds",
            "Gap between consecutive chunks relayed to a client (streams); one chunk is usually "
            "one verify step",
            ("model",),
            INTER_CHUNK_BUCKETS,
        )
        self.tpot = histogram(
            "time_per_output_token_seconds",
            "Time per output token after the first: (last chunk - first chunk) / "
            "(completion tokens - 1), per stream",
            ("model",),
            TPOT_BUCKETS,
        )
        # Tokens and DFlash acceptance.
        self.prompt_tokens = counter(
            "prompt_tokens", "Prompt tokens of answered requests", ("model", "worker")
        )
        self.completion_tokens = counter(
            "completion_tokens", "Completion tokens of answered requests", ("model", "worker")
        )
        self.reasoning_tokens = counter(
            "reasoning_tokens",
            "Reasoning tokens of answered requests (part of the completion tokens)",
            ("model", "worker"),
        )
        self.verify_steps = counter(
            "spec_verify_steps",
            "Speculative verify steps of answered requests (exact from meta_info, else estimated "
            "from stream chunks); completion_tokens_total / this = token-weighted acceptance "
            "length",
            ("model", "worker"),
        )
        self.accept_length = histogram(
            "spec_accept_length",
            "Per-request DFlash acceptance length (completion tokens per verify step); "
            "source=exact from the worker's meta_info, estimated from stream chunks",
            ("model", "source"),
            ACCEPT_LENGTH_BUCKETS,
        )
        self.throughput = gauge(
            "output_throughput_tokens_per_second",
            f"Completion tokens per second through this gateway over the last "
            f"{THROUGHPUT_WINDOW_S} s",
            ("model",),
            "livesum",
        )
        # Workers, as the gateway sees them (read from the pool when scraped).
        self.in_flight = gauge(
            "in_flight_requests", "Requests in flight per worker", ("worker",), "livesum"
        )
        self.queue_depth = gauge(
            "queue_depth", "Requests waiting in the admission queue", (), "livesum"
        )
        self.worker_up = gauge(
            "worker_up",
            "1 if the worker passes health checks and its circuit breaker is closed",
            ("worker",),
            "livemax",
        )
        self.worker_breaker = gauge(
            "worker_breaker_state",
            "Circuit breaker state: 0 closed, 1 open, 2 half-open",
            ("worker",),
            "livemax",
        )
        self.worker_throughput = gauge(
            "worker_output_throughput_tokens_per_second",
            "The worker's own generation throughput (/v1/loads gen_throughput)",
            ("worker",),
            "livemostrecent",
        )
        self.worker_accept_length = gauge(
            "worker_spec_accept_length",
            "The worker's own average acceptance length (/v1/loads speculative.accept_length)",
            ("worker",),
            "livemostrecent",
        )
        self.worker_accept_rate = gauge(
            "worker_spec_accept_rate",
            "The worker's own draft acceptance rate (/v1/loads speculative.accept_rate)",
            ("worker",),
            "livemostrecent",
        )
        # Per API key NAME (never the key); label values are configured names only.
        self.key_requests = counter("key_requests", "Requests per API key name", ("key",))
        self.key_completion_tokens = counter(
            "key_completion_tokens", "Completion tokens per API key name", ("key",)
        )
        self.dropped_fields = counter(
            "requests_with_dropped_fields",
            "Requests that held fields not on the allow-list (not forwarded to the worker)",
            ("route",),
        )

        for outcome in STREAM_OUTCOMES:
            self.stream_outcomes.labels(outcome)
        for route in ROUTES:
            self.dropped_fields.labels(route)
        for reason in (*sorted(RETRY_REASONS), OTHER):
            self.retries.labels(reason)
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
        for route in ROUTES:
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
            self.completion_tokens,
            self.reasoning_tokens,
            self.verify_steps,
        ):
            counter.labels(model, worker)

    def add_model(self, model: str) -> None:
        self._model(model)

    def add_worker(self, worker: str) -> None:
        """Pre-initialise a worker's series so they exist from start-up."""
        if worker in self._workers:
            return
        self._workers.add(worker)
        for outcome in ATTEMPT_OUTCOMES:
            self.upstream_attempts.labels(worker, outcome)
        for gauge in (self.in_flight, self.worker_up, self.worker_breaker, self.worker_throughput):
            gauge.labels(worker)
        for model in self._models - {OTHER}:
            self._model_worker(model, worker)

    def _forget_worker(self, worker: str) -> None:
        """A worker left the pool: its gauges go (in multiprocess mode they are filtered out when
        rendering, since a file's entries cannot be removed)."""
        self._workers.discard(worker)
        for gauge in (
            self.in_flight,
            self.worker_up,
            self.worker_breaker,
            self.worker_throughput,
            self.worker_accept_length,
            self.worker_accept_rate,
        ):
            if self.multiprocess:
                if gauge is self.in_flight:
                    gauge.labels(worker).set(0)
                continue
            with contextlib.suppress(KeyError):
                gauge.remove(worker)

    def add_key(self, name: str) -> None:
        """Pre-initialise a configured API key name's series."""
        self.key_requests.labels(name)
        self.key_completion_tokens.labels(name)

    # -- once per request ---------------------------------------------------------------------

    def record_dropped_fields(self, route: str) -> None:
        self._child(self.dropped_fields, route).inc()

    def record_request(
        self, route: str, model: str, status: int, duration_s: float | None = None
    ) -> None:
        label = self._model(model)
        code = str(status) if 100 <= status <= 599 else OTHER
        self._child(self.requests, route, label, code).inc()
        if duration_s is not None:
            self._child(self.request_duration, route, label).observe(duration_s)

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
    ) -> None:
        """One request's token counts and verify steps (None: not known). ``source``: the
        per-request acceptance length is ``exact`` or ``estimated``; None: only the worker's mean
        was known (the steps count, the per-request histogram does not)."""
        label = self._model(model)
        self.add_worker(worker)
        if prompt:
            self._child(self.prompt_tokens, label, worker).inc(prompt)
        if reasoning:
            self._child(self.reasoning_tokens, label, worker).inc(reasoning)
        if not completion:
            return
        self._child(self.completion_tokens, label, worker).inc(completion)
        window = self._windows.get(label)
        if window is not None:
            window.add(self._clock(), completion)
        if verify_steps:
            self._child(self.verify_steps, label, worker).inc(verify_steps)
            if source in SOURCES:
                self._child(self.accept_length, label, source).observe(completion / verify_steps)

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
        self._child(self.ttft, label).observe(ttft_s)
        if not chunk_times:
            return
        observe_gaps(self._child(self.inter_chunk, label), first_at, chunk_times)
        if completion_tokens and completion_tokens > 1:
            tpot = (chunk_times[-1] - first_at) / (completion_tokens - 1)
            self._child(self.tpot, label).observe(tpot)

    def record_queue_wait(self, seconds: float) -> None:
        self.queue_wait.observe(seconds)

    def record_attempt(self, worker: str, outcome: str) -> None:
        self._child(self.upstream_attempts, worker, outcome).inc()

    def record_retry(self, reason: str) -> None:
        self._child(self.retries, reason if reason in RETRY_REASONS else OTHER).inc()

    def record_abort(self) -> None:
        self.aborts_sent.inc()

    def record_stream(self, outcome: str) -> None:
        self._child(self.stream_outcomes, outcome if outcome in STREAM_OUTCOMES else OTHER).inc()

    def record_key_request(self, name: str) -> None:
        self._child(self.key_requests, name).inc()

    def record_key_tokens(self, name: str, completion_tokens: int) -> None:
        self._child(self.key_completion_tokens, name).inc(completion_tokens)

    # -- when scraped -------------------------------------------------------------------------

    def observe_pool(self, workers: Iterable[WorkerView], queue_depth: int) -> None:
        """Worker-side gauges, queue depth and the gateway's tokens/s, from the pool now."""
        current: set[str] = set()
        for w in workers:
            name = w.name
            current.add(name)
            self.add_worker(name)
            for model in w.models:
                self._model(model)
            self.in_flight.labels(name).set(w.in_flight)
            self.worker_up.labels(name).set(1 if w.up else 0)
            self.worker_breaker.labels(name).set(int(w.breaker.state))
            load = w.load
            self.worker_throughput.labels(name).set(load.gen_throughput)
            if load.accept_length is not None:
                self.worker_accept_length.labels(name).set(load.accept_length)
            if load.accept_rate is not None:
                self.worker_accept_rate.labels(name).set(load.accept_rate)
        for gone in self._workers - current:
            self._forget_worker(gone)
        self.queue_depth.set(queue_depth)
        now = self._clock()
        for model, window in self._windows.items():
            self.throughput.labels(model).set(window.rate(now))

    async def keep_fresh(
        self,
        workers: Callable[[], Iterable[WorkerView]],
        queue_depth: Callable[[], int],
        interval_s: float = 1.0,
    ) -> None:
        """``observe_pool`` every ``interval_s`` until cancelled. In multiprocess mode a scrape is
        answered by one process, which reads the others' gauges from their files: they must
        keep them current themselves."""
        while True:
            self.observe_pool(workers(), queue_depth())
            await asyncio.sleep(interval_s)

    def render(self) -> bytes:
        if not self.multiprocess:
            return generate_latest(self.registry)
        registry = CollectorRegistry()
        merged = MultiProcessCollector(None)  # type: ignore[no-untyped-call]
        registry.register(_CurrentWorkers(merged, set(self._workers)))
        return generate_latest(registry)


def observe_gaps(child: Histogram, first_at: float, times: Sequence[float]) -> None:
    """``child.observe(gap)`` for every gap between consecutive readings, in one pass: a bisect
    per gap and one update per bucket instead of a locked update per observation."""
    bounds: list[float] = child._upper_bounds  # prometheus_client's own layout
    counts = [0] * len(bounds)
    total = 0.0
    previous = first_at
    for at in times:
        gap = at - previous
        previous = at
        total += gap
        counts[bisect.bisect_left(bounds, gap)] += 1
    buckets = child._buckets
    for i, count in enumerate(counts):
        if count:
            buckets[i].inc(count)
    child._sum.inc(total)


class _CurrentWorkers(Collector):
    """Multiprocess exposition without the gauges of workers that left the pool."""

    def __init__(self, inner: Collector, workers: set[str]) -> None:
        self._inner = inner
        self._workers = workers

    def collect(self) -> Iterator[Metric]:
        for metric in self._inner.collect():
            if metric.name in _WORKER_GAUGES:
                metric.samples = [
                    s for s in metric.samples if s.labels.get("worker", "") in self._workers
                ]
            yield metric
