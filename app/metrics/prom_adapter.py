"""The one place that relies on prometheus_client's internals (pinned in pyproject.toml to the
versions ``tests/metrics/test_prometheus_contract.py`` has seen; that test names what changed):

- whether the library writes multiprocess files: ``values.ValueClass._multiprocess``, fixed
  when prometheus_client is first imported (``PROMETHEUS_MULTIPROC_DIR`` set or not);
- a histogram child's layout (``_upper_bounds``, ``_buckets``, ``_sum``): a stream's chunk gaps
  are added in one pass rather than one locked ``observe`` per gap, and the observations a
  ``Metrics`` batch held are added as bucket counts (``add_counts``);
- multiprocess exposition without the gauges of workers that left the pool: a collector
  wrapping ``MultiProcessCollector`` that rewrites ``Metric.samples`` (a file's entries cannot
  be removed).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator, Sequence

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client import values as prometheus_values
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.metrics_core import Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

# prometheus-client releases (major.minor) the contract test has passed on.
TESTED_VERSIONS = ("0.26",)
CONTENT_TYPE = CONTENT_TYPE_LATEST


def multiprocess_mode() -> bool:
    """prometheus_client writes to ``PROMETHEUS_MULTIPROC_DIR`` (set before it was imported)."""
    return bool(getattr(prometheus_values.ValueClass, "_multiprocess", False))


def upper_bounds(child: Histogram) -> list[float]:
    """A histogram child's bucket bounds, ascending, ``+Inf`` last: an observation ``v`` goes
    to bucket ``bisect_left(bounds, v)`` (prometheus_client's ``v <= bound``)."""
    bounds: list[float] = child._upper_bounds
    return bounds


def add_counts(child: Histogram, counts: Sequence[int], total: float) -> None:
    """Add ``counts[i]`` observations to bucket ``i`` of ``child`` and ``total`` to its sum: what
    one ``observe`` per observation would have done."""
    buckets = child._buckets
    for i, count in enumerate(counts):
        if count:
            buckets[i].inc(count)
    child._sum.inc(total)


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


class CurrentWorkers(Collector):
    """``inner``'s metrics, with the samples of ``worker_gauges`` kept only for current
    ``workers``."""

    def __init__(self, inner: Collector, worker_gauges: frozenset[str], workers: set[str]) -> None:
        self._inner = inner
        self._worker_gauges = worker_gauges
        self._workers = workers

    def collect(self) -> Iterator[Metric]:
        for metric in self._inner.collect():
            if metric.name in self._worker_gauges:
                metric.samples = [
                    s for s in metric.samples if s.labels.get("worker", "") in self._workers
                ]
            yield metric


def render(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)


def render_multiprocess(worker_gauges: frozenset[str], workers: set[str]) -> bytes:
    """Every process's files merged (counters and histograms add up, gauges by their mode),
    without the ``worker_gauges`` samples of workers not in ``workers``."""
    registry = CollectorRegistry()
    merged = MultiProcessCollector(None)  # type: ignore[no-untyped-call]
    registry.register(CurrentWorkers(merged, worker_gauges, workers))
    return generate_latest(registry)
