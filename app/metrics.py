"""Every Prometheus object the gateway exports, on a registry owned by the app (no globals).

Label values are bounded and server-controlled: route from a fixed set, model = a served model the
pool knows (else ``other``), worker = the worker's stable name, status = the HTTP status we sent.
This is the request-counter core; the metrics issue adds latency/throughput/DFlash series.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

PREFIX = "dflash_gateway_"
CONTENT_TYPE = CONTENT_TYPE_LATEST
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


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            PREFIX + "requests",
            "Client requests answered",
            ["route", "model", "status"],
            registry=r,
        )
        self.stream_outcomes = Counter(
            PREFIX + "stream_outcomes", "How streams ended", ["outcome"], registry=r
        )
        self.upstream_attempts = Counter(
            PREFIX + "upstream_attempts",
            "Requests sent to workers, by outcome",
            ["worker", "outcome"],
            registry=r,
        )
        self.retries = Counter(
            PREFIX + "retries", "Attempts retried on another worker", ["reason"], registry=r
        )
        self.aborts_sent = Counter(
            PREFIX + "aborts_sent", "POST /abort_request calls sent to workers", registry=r
        )
        self.in_flight = Gauge(
            PREFIX + "in_flight_requests",
            "Requests in flight per worker",
            ["worker"],
            registry=r,
            multiprocess_mode="livesum",
        )
        # Per API key NAME (never the key); label values are configured names only.
        self.key_requests = Counter(
            PREFIX + "key_requests", "Requests per API key name", ["key"], registry=r
        )
        self.key_completion_tokens = Counter(
            PREFIX + "key_completion_tokens",
            "Completion tokens per API key name",
            ["key"],
            registry=r,
        )
        for outcome in STREAM_OUTCOMES:
            self.stream_outcomes.labels(outcome)

    def add_worker(self, worker: str) -> None:
        """Pre-initialise a worker's series so they exist from start-up."""
        for outcome in ATTEMPT_OUTCOMES:
            self.upstream_attempts.labels(worker, outcome)
        self.in_flight.labels(worker)

    def add_key(self, name: str) -> None:
        """Pre-initialise a configured API key name's series."""
        self.key_requests.labels(name)
        self.key_completion_tokens.labels(name)

    def record_key_request(self, name: str) -> None:
        self.key_requests.labels(name).inc()

    def record_key_tokens(self, name: str, completion_tokens: int) -> None:
        self.key_completion_tokens.labels(name).inc(completion_tokens)

    def record_request(self, route: str, model: str, status: int) -> None:
        self.requests.labels(route, model, str(status)).inc()

    def record_attempt(self, worker: str, outcome: str) -> None:
        self.upstream_attempts.labels(worker, outcome).inc()

    def record_retry(self, reason: str) -> None:
        self.retries.labels(reason).inc()

    def record_abort(self) -> None:
        self.aborts_sent.inc()

    def record_stream(self, outcome: str) -> None:
        self.stream_outcomes.labels(outcome).inc()

    def observe_in_flight(self, counts: dict[str, int]) -> None:
        for worker, count in counts.items():
            self.in_flight.labels(worker).set(count)

    def render(self) -> bytes:
        return generate_latest(self.registry)
