"""Every Prometheus metric the gateway exports (docs/contracts.md, "Metrics"), on a registry held by
the app (no globals), and the ``record_*`` helpers the proxy calls once per request.

Label values are bounded and server-controlled: ``route`` from a fixed set (the surface
registry's paths, ``app.surfaces``, given to ``Metrics``); ``model`` = a served
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

``families.py`` defines the families, ``recorder.py`` holds ``Metrics`` (label values,
``record_*``, the scrape), ``pool.py`` each worker's series, ``held.py`` how a request's updates
reach the series (held until the next collect), ``prom_adapter.py`` everything that relies on
prometheus_client's internals.
"""

from __future__ import annotations

from app.metrics.families import (
    ACCEPT_LENGTH_BUCKETS,
    DURATION_BUCKETS,
    INTER_CHUNK_BUCKETS,
    MAX_MODELS,
    OTHER,
    PREFIX,
    QUEUE_BUCKETS,
    RETRY_REASONS,
    SOURCES,
    STATUSES,
    THROUGHPUT_WINDOW_S,
    TPOT_BUCKETS,
    TTFT_BUCKETS,
    Families,
)
from app.metrics.pool import WorkerView
from app.metrics.prom_adapter import CONTENT_TYPE, multiprocess_mode, observe_gaps
from app.metrics.recorder import Metrics, TokenWindow
from app.outcomes import ATTEMPT_OUTCOMES, STREAM_OUTCOMES

__all__ = [
    "ACCEPT_LENGTH_BUCKETS",
    "ATTEMPT_OUTCOMES",
    "CONTENT_TYPE",
    "DURATION_BUCKETS",
    "INTER_CHUNK_BUCKETS",
    "MAX_MODELS",
    "OTHER",
    "PREFIX",
    "QUEUE_BUCKETS",
    "RETRY_REASONS",
    "SOURCES",
    "STATUSES",
    "STREAM_OUTCOMES",
    "THROUGHPUT_WINDOW_S",
    "TPOT_BUCKETS",
    "TTFT_BUCKETS",
    "Families",
    "Metrics",
    "TokenWindow",
    "WorkerView",
    "multiprocess_mode",
    "observe_gaps",
]
