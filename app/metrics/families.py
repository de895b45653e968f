"""The gateway's metric families (docs/contracts.md, "Metrics"): bucket layouts, the bounded
label value sets, and ``Families``, which defines every family on a registry. ``Metrics``
(``recorder.py``) adds the label values and records into them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

PREFIX = "dflash_gateway_"
OTHER = "other"
MAX_MODELS = 32
# requests_total series that exist before the first such answer (alerts divide by them).
STATUSES = ("200", "400", "404", "429", "499", "500", "502", "503", "504")
# ``retries_total{reason}``: the error code of the failed attempt.
RETRY_REASONS = frozenset(
    {
        "upstream_unavailable",
        "stream_interrupted",
        "upstream_timeout",
        "bad_upstream_response",
        "502",
        "503",
        "504",
        "prefill_failed",
    }
)
SOURCES = ("exact", "estimated")
# ``stream_continuations_total{outcome}`` (``app.proxy.continuation``): ok (the continuation relayed
# the rest of the stream), failed (it broke too), and why none was started: no_worker (no other
# healthy worker), limit (retry.mid_stream_attempts used up), not_continuable (the stream had
# tool-call deltas or its finish already).
CONTINUATION_OUTCOMES = ("ok", "failed", "no_worker", "limit", "not_continuable")
# ``upstream_violations_total{worker,kind}``: how a worker's answer was out of step.
VIOLATIONS = ("foreign_answer", "data_after_done")
# Token quotas a request can be refused by (``tenants.*``).
QUOTAS = ("tokens_per_min", "tokens_per_day")
# The supervised background tasks (``app.background``); "usage" is the usage log's writer thread.
BACKGROUND_TASKS = ("discovery", "health", "loads", "metrics", "keys", "usage", "kv_events")
# ``kv_events_blocks_total{worker,kind}`` / ``kv_events_tokens_total``: what the workers' KV
# events reported (``app.workers.kv_events``).
KV_EVENT_KINDS = ("stored", "removed")
# What a shared limit store (Redis) holds: request rate + concurrency limits, token quotas.
LIMIT_STORES = ("requests", "tokens", "session_homes")

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
# The KV-transfer wait of a PD pair: from milliseconds (same node) to the bootstrap timeout.
KV_WAIT_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300,
)  # fmt: skip
QUEUE_BUCKETS = (
    0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120,
)  # fmt: skip
THROUGHPUT_WINDOW_S = 10
GaugeMode = Literal["livesum", "livemax", "livemostrecent"]
# Gauges whose worker label must match a current pool member (multiprocess exposition).
WORKER_GAUGES = frozenset(
    PREFIX + name
    for name in (
        "in_flight_requests",
        "worker_up",
        "worker_breaker_state",
        "worker_spec_accept_length",
        "worker_spec_accept_rate",
        "worker_output_throughput_tokens_per_second",
        "worker_measured_accept_length",
        "worker_accept_collapsed",
        "worker_engine_info",
        "worker_running_requests",
        "worker_waiting_requests",
        "worker_queued_prefill_tokens",
        "worker_kv_transfer_queue_requests",
    )
)


class Families:
    """Every metric family, defined on ``registry``, as attributes named after what they count."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        r = registry

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
        self.routing_decisions = counter(
            "routing_decisions",
            "Why each request went to its worker (cache_aware): cache_hit (the worker holding "
            "more of its prompt than its key's home), affinity (its key's home), spill (its key's "
            "home was too loaded), no_key, full (every worker full), single (one candidate)",
            ("policy", "reason"),
        )
        self.stream_continuations = counter(
            "stream_continuations",
            "Broken streams continued on another worker, by outcome (docs/routing.md)",
            ("outcome",),
        )
        self.kv_event_blocks = counter(
            "kv_events_blocks",
            "Prefix-cache blocks the workers' KV events reported, by kind: stored, removed "
            "(evicted, or dropped by the worker for any reason)",
            ("worker", "kind"),
        )
        self.kv_event_tokens = counter(
            "kv_events_tokens",
            "Tokens in the blocks the workers' KV events reported stored or removed",
            ("worker", "kind"),
        )
        self.kv_event_clears = counter(
            "kv_events_clears", "AllBlocksCleared events (a flushed cache), by worker", ("worker",)
        )
        self.kv_event_gaps = counter(
            "kv_events_gaps",
            "KV event batches received after missed ones (first batch after subscribing, a "
            "skipped or restarted sequence, an undecodable batch): the worker's cache state was "
            "unknown until then",
            ("worker",),
        )
        self.upstream_violations = counter(
            "upstream_violations",
            "Worker answers out of step with the request, by kind: foreign_answer (the answer or "
            "the stream's first event carried another request's id; the connection was closed "
            "and the attempt failed), data_after_done (data after a stream's [DONE]; not "
            "relayed, the connection closed, the client's answer kept)",
            ("worker", "kind"),
        )
        self.aborts_sent = counter(
            "aborts_sent",
            "POST /abort_request calls sent to workers (SGLang; a vLLM request is aborted by "
            "closing its connection, not counted here)",
        )
        self.queue_wait = histogram(
            "queue_wait_seconds",
            "Time a request waited for a worker with capacity (admission queue), by priority class",
            ("priority",),
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
        self.cached_prompt_tokens = counter(
            "cached_prompt_tokens",
            "Prompt tokens the worker served from its prefix cache (its usage's "
            "prompt_tokens_details.cached_tokens); / prompt_tokens_total = its cache hit ratio",
            ("model", "worker"),
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
            "in_flight_requests", "Requests in flight per worker", ("worker", "role"), "livesum"
        )
        self.worker_running = gauge(
            "worker_running_requests",
            "Requests the worker reports running (a decode worker's running batch)",
            ("worker", "role"),
            "livemostrecent",
        )
        self.worker_waiting = gauge(
            "worker_waiting_requests",
            "Requests the worker reports queued (a prefill worker's prefill queue)",
            ("worker", "role"),
            "livemostrecent",
        )
        self.worker_queued_prefill_tokens = gauge(
            "worker_queued_prefill_tokens",
            "Prompt tokens the worker reports queued for prefill, not served from its prefix "
            "cache (SGLang: num_waiting_uncached_tokens); what least_queued picks prefill by",
            ("worker", "role"),
            "livemostrecent",
        )
        self.worker_transfer_queue = gauge(
            "worker_kv_transfer_queue_requests",
            "PD disaggregation: requests the worker holds for a KV transfer (SGLang's "
            "disaggregation queues: bootstrap + in flight on a prefill worker, prealloc + "
            "transfer on a decode worker)",
            ("worker", "role"),
            "livemostrecent",
        )
        self.queue_depth = gauge(
            "queue_depth", "Requests waiting in the admission queue", (), "livesum"
        )
        self.worker_up = gauge(
            "worker_up",
            "1 if the worker passes health checks and its circuit breaker is closed",
            ("worker", "role"),
            "livemax",
        )
        self.worker_breaker = gauge(
            "worker_breaker_state",
            "Circuit breaker state: 0 closed, 1 open, 2 half-open",
            ("worker", "role"),
            "livemax",
        )
        self.worker_engine = gauge(
            "worker_engine_info",
            "1 for the serving engine the worker runs (sglang, vllm; unknown until admitted)",
            ("worker", "role", "engine"),
            "livemax",
        )
        self.worker_throughput = gauge(
            "worker_output_throughput_tokens_per_second",
            "The worker's own generation throughput (SGLang: /v1/loads gen_throughput; vLLM: "
            "the rate of vllm:generation_tokens_total between polls)",
            ("worker", "role"),
            "livemostrecent",
        )
        self.worker_accept_length = gauge(
            "worker_spec_accept_length",
            "The worker's own average acceptance length (SGLang: /v1/loads "
            "speculative.accept_length; vLLM: 1 + accepted / drafts of its spec_decode counters "
            "between polls)",
            ("worker", "role"),
            "livemostrecent",
        )
        self.worker_accept_rate = gauge(
            "worker_spec_accept_rate",
            "The worker's own draft acceptance rate (SGLang: /v1/loads speculative.accept_rate; "
            "vLLM: accepted / draft tokens between polls)",
            ("worker", "role"),
            "livemostrecent",
        )
        self.worker_measured_accept = gauge(
            "worker_measured_accept_length",
            "EWMA over the worker's requests through this gateway of their acceptance length "
            "(exact or estimated per request; what acceptance-collapse detection compares)",
            ("worker", "role"),
            "livemostrecent",
        )
        self.worker_collapsed = gauge(
            "worker_accept_collapsed",
            "1 if the worker's measured acceptance length is far below its peers' median "
            "(routing.collapse_ratio): a drafter/target mismatch",
            ("worker", "role"),
            "livemax",
        )
        self.kv_transfer_wait = histogram(
            "pd_kv_transfer_wait_seconds",
            "PD disaggregation: from a pair's request sent to both workers to the decode "
            "worker's first data event, less the prefill worker's own time (docs/pd.md)",
            ("model",),
            KV_WAIT_BUCKETS,
        )
        self.fleet_saturation = gauge(
            "fleet_saturation",
            "Requests running or waiting on routable workers plus the admission queue, over the "
            "routable workers' summed caps (1 = every slot taken); the autoscaling signal",
            (),
            "livemax",
        )
        # Per API key NAME (never the key); label values are configured names only.
        self.key_requests = counter("key_requests", "Requests per API key name", ("key",))
        self.key_completion_tokens = counter(
            "key_completion_tokens", "Completion tokens per API key name", ("key",)
        )
        self.key_prompt_tokens = counter(
            "key_prompt_tokens", "Prompt tokens per API key name", ("key",)
        )
        self.key_reasoning_tokens = counter(
            "key_reasoning_tokens",
            "Reasoning tokens per API key name (part of its completion tokens)",
            ("key",),
        )
        self.quota_rejections = counter(
            "quota_rejections",
            "Requests refused with 429 because their key was over a quota, by quota",
            ("key", "quota"),
        )
        self.limit_store_errors = counter(
            "limit_store_errors",
            "Calls to the shared limit store (Redis) that failed; the request was let through "
            "unlimited (fail open), by limit (session_homes: cache_aware's shared session "
            "homes, routed on the replica's own index instead)",
            ("limit",),
        )
        self.usage_log_dropped = counter(
            "usage_log_dropped_lines",
            "Usage log lines dropped because the writer fell behind or the disk failed",
        )
        self.client_write_timeouts = counter(
            "client_write_timeouts",
            "Client connections closed because the client took none of a response's bytes for "
            "timeouts.client_write_s",
        )
        self.background_restarts = counter(
            "background_task_restarts",
            "Background tasks restarted after they crashed (logged with the traceback), by task",
            ("task",),
        )
        self.dropped_fields = counter(
            "requests_with_dropped_fields",
            "Requests that held fields not on the allow-list (not forwarded to the worker)",
            ("route",),
        )
