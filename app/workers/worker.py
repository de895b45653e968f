"""One worker (SGLang or vLLM) as the gateway sees it: identity, engine, health, in-flight
requests, last load, and the capacity it reports."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal
from urllib.parse import urlsplit

from app.workers.breaker import BreakerState, CircuitBreaker

if TYPE_CHECKING:
    from app.workers.engines import Engine, EngineName


Role = Literal["whole", "prefill", "decode"]
ROLES: tuple[Role, ...] = ("whole", "prefill", "decode")


class WorkerState(enum.Enum):
    STARTING = "starting"  # not yet seen healthy (SGLang answers 503 while loading)
    HEALTHY = "healthy"
    UNHEALTHY = "unhealthy"  # failed the active health check threshold
    DRAINING = "draining"  # terminating endpoint: finishes in-flight work, gets no new requests


@dataclass(frozen=True, slots=True)
class WorkerLoad:
    """The worker's own view, polled through its engine (SGLang's ``/v1/loads?include=core,spec``,
    vLLM's ``/metrics``)."""

    running: int = 0
    waiting: int = 0
    token_usage: float = 0.0
    gen_throughput: float = 0.0
    accept_length: float | None = None
    accept_rate: float | None = None
    # The worker's own limits, as its scheduler applies them (summed over dp ranks).
    max_running_requests: int | None = None
    max_total_num_tokens: int | None = None
    # Prompt tokens queued for prefill, not served from the prefix cache (SGLang:
    # ``num_waiting_uncached_tokens``): what a prefill worker is picked by.
    waiting_tokens: int = 0
    # PD disaggregation: requests held for a KV transfer (SGLang's /v1/loads ``disaggregation``
    # queues: bootstrap + in flight on a prefill worker, prealloc + transfer on a decode one).
    transfer_queue: int = 0


_RATE_ALPHA = 0.3
_RATE_SKIP_POLLS = 2

# SGLang's DFLASH default (``max_running_requests`` forced to 48): a worker's capacity until it
# reports its own.
DEFAULT_CAPACITY = 48


@dataclass(slots=True)
class Acceptance:
    """The acceptance length this gateway measured on the worker's requests
    (``app.workers.acceptance``): an EWMA over requests, how many fed it, and whether the worker is
    flagged as collapsed against its peers."""

    ewma: float | None = None
    samples: int = 0
    collapsed: bool = False

    def reset(self) -> None:
        self.ewma, self.samples, self.collapsed = None, 0, False


def stable_name(url: str) -> str:
    """host:port of a URL: the worker's name when discovery gives none (a pod name)."""
    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    host = parts.hostname or ""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


@dataclass(eq=False)
class Worker:
    url: str
    name: str = ""
    state: WorkerState = WorkerState.STARTING
    models: tuple[str, ...] = ()
    in_flight: int = 0
    load: WorkerLoad = field(default_factory=WorkerLoad)
    # ``in_flight`` when ``load`` was taken: requests sent since are not in the worker's counts yet.
    in_flight_at_load: int = 0
    # capacity - busy == room - in_flight (both set with the load; see ``busy``).
    room: int = DEFAULT_CAPACITY
    # Output tokens per second per running request: smoothed gen_throughput over smoothed
    # running across polls (the throughput is a window, running an instant); kept while idle.
    rate: float | None = None
    _throughput_avg: float = 0.0
    _running_avg: float = 0.0
    _busy_polls: int = 0
    # The served model's context length (``max_model_len`` of its /v1/models card).
    context_length: int | None = None
    breaker: CircuitBreaker = field(default_factory=CircuitBreaker)
    accept: Acceptance = field(default_factory=Acceptance)
    # The engine it runs (``app.workers.engines``): settled when it is admitted; None before.
    engine: Engine | None = None
    # The engine its URL names (``vllm+http://...``), which no detection overrides.
    engine_pin: EngineName | None = None
    # Its part in prefill/decode disaggregation (docs/pd.md): whole (serves requests alone),
    # prefill or decode; a prefill worker's bootstrap port (``--disaggregation-bootstrap-port``).
    role: Role = "whole"
    bootstrap_port: int | None = None

    def __post_init__(self) -> None:
        from app.workers.engines import split_engine_url

        pin, url = split_engine_url(self.url)
        self.engine_pin = pin or self.engine_pin
        self.url = url.rstrip("/")
        if not self.name:
            self.name = stable_name(self.url)

    @property
    def engine_name(self) -> str:
        """``sglang``, ``vllm``, or ``unknown`` before it was admitted."""
        return self.engine.name if self.engine is not None else (self.engine_pin or "unknown")

    @property
    def routable(self) -> bool:
        """Healthy, and its breaker lets a request through (in half-open: the one probe)."""
        return self.state is WorkerState.HEALTHY and self.breaker.allows()

    @property
    def up(self) -> bool:
        """Healthy with a closed breaker (``dflash_gateway_worker_up``)."""
        return self.state is WorkerState.HEALTHY and self.breaker.state is BreakerState.CLOSED

    @property
    def capacity(self) -> int:
        """Requests the worker runs at once: its reported ``max_running_requests``, else 48."""
        return self.load.max_running_requests or DEFAULT_CAPACITY

    @property
    def busy(self) -> int:
        """Requests on the worker now: its polled running + waiting (every gateway replica's),
        plus ours sent since that poll, and never fewer than ours in flight."""
        polled = self.load.running + self.load.waiting
        return max(self.in_flight, polled + self.in_flight - self.in_flight_at_load)

    def set_load(self, load: WorkerLoad) -> None:
        """A freshly polled load (always set it through here: ``room`` follows it)."""
        self.load = load
        self.in_flight_at_load = self.in_flight
        capacity = self.capacity
        self.room = min(capacity, capacity - load.running - load.waiting + self.in_flight)
        if load.running <= 0:
            self._busy_polls = 0  # idle: keep the last rate
            return
        self._busy_polls += 1
        # gen_throughput covers a trailing window: the first busy polls after an idle spell
        # pair a window that was partly idle with the requests running now, so they are skipped.
        if self._busy_polls <= _RATE_SKIP_POLLS:
            return
        if self._busy_polls == _RATE_SKIP_POLLS + 1 or self.rate is None:
            self._throughput_avg, self._running_avg = load.gen_throughput, float(load.running)
        else:  # EWMA of both over the busy polls, then their ratio
            self._throughput_avg += _RATE_ALPHA * (load.gen_throughput - self._throughput_avg)
            self._running_avg += _RATE_ALPHA * (load.running - self._running_avg)
        if self._throughput_avg > 0:
            self.rate = self._throughput_avg / self._running_avg

    @property
    def load_score(self) -> float:
        """What load-aware policies compare: our in-flight requests, then the worker's queue."""
        return self.in_flight + self.load.waiting + self.load.token_usage

    def attempt_guard(self, source: str | None = None) -> AttemptGuard:
        """One upstream attempt on this worker: counted in flight for the block, whatever happens,
        and exactly one verdict for the circuit breaker when it ends (see ``Verdict``);
        ``source``: the API key of the request."""
        return AttemptGuard(self, source)


class AttemptGuard:
    """``Worker.attempt_guard``'s block (a plain context manager: one per upstream attempt)."""

    __slots__ = ("_source", "_verdict", "_worker")

    def __init__(self, worker: Worker, source: str | None = None) -> None:
        self._worker = worker
        self._source = source
        self._verdict: Verdict | None = None

    def __enter__(self) -> Verdict:
        worker = self._worker
        worker.in_flight += 1
        worker.breaker.on_attempt()
        verdict = self._verdict = Verdict(self._source)
        return verdict

    def __exit__(self, *exc: object) -> None:
        worker, verdict = self._worker, self._verdict
        assert verdict is not None
        worker.in_flight -= 1
        if verdict.fault is None:
            worker.breaker.on_released()
        elif verdict.fault:
            worker.breaker.on_failure(verdict.source if verdict.requested else None)
        else:
            worker.breaker.on_success()


class Verdict:
    """What an attempt tells its worker's breaker. ``fault`` True: the worker failed (it counts
    towards opening the breaker); False: the worker answered (even a 4xx, the request's fault);
    left None (the client left, the gateway stopped): no verdict, the half-open probe slot is
    freed. ``requested``: the failure was the worker's answer to the request (an error status),
    so it may be the request's doing and counts against the request's key, ``source``
    (``app.workers.breaker``)."""

    __slots__ = ("fault", "requested", "source")

    def __init__(self, source: str | None = None) -> None:
        self.fault: bool | None = None
        self.requested = False
        self.source = source
