"""How a request's counter increments and histogram observations reach prometheus_client.

``Pending`` holds them in plain Python (a sum per counter series, bucket counts and a sum per
histogram series: bounded by the series, not the requests) and adds them to prometheus_client's
series at the next collect (a scrape, or any ``registry.collect``/``get_sample_value``, through
``FlushFirst``): a request pays a dict update where prometheus_client takes a lock and runs its
checks per call, and a histogram's bucket is found by one ``bisect`` rather than a scan of its
bounds. In multiprocess mode (``--processes N``), where another process reads this one's files,
``AtOnce`` sends every update to the files at once.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from app.metrics.prom_adapter import add_counts, observe_gaps, upper_bounds


class Updates(Protocol):
    """Where ``Metrics`` sends a series' updates: ``child`` is a counter's or histogram's child."""

    def inc(self, child: Any, amount: float = 1) -> None: ...
    def observe(self, child: Any, value: float) -> None: ...
    def observe_gaps(self, child: Any, first_at: float, times: Sequence[float]) -> None: ...
    def flush(self) -> None: ...


class _Held:
    """A histogram series' observations not yet added to it: bucket counts and their sum."""

    __slots__ = ("bounds", "counts", "total")

    def __init__(self, bounds: list[float]) -> None:
        self.bounds = bounds
        self.counts = [0] * len(bounds)
        self.total = 0.0


class Pending:
    """The updates held until the next collect."""

    __slots__ = ("_counts", "_held")

    def __init__(self) -> None:
        self._counts: dict[Any, float] = {}
        self._held: dict[Any, _Held] = {}

    def inc(self, child: Any, amount: float = 1) -> None:
        """``child.inc(amount)`` at the next collect."""
        if amount < 0:
            raise ValueError("counters can only be incremented by non-negative amounts")
        counts = self._counts
        counts[child] = counts.get(child, 0) + amount

    def observe(self, child: Any, value: float) -> None:
        """``child.observe(value)`` at the next collect."""
        held = self._held.get(child)
        if held is None:
            held = self._held[child] = _Held(upper_bounds(child))
        held.counts[bisect_left(held.bounds, value)] += 1
        held.total += value

    def observe_gaps(self, child: Any, first_at: float, times: Sequence[float]) -> None:
        """``observe(gap)`` for every gap between consecutive clock readings, in one pass."""
        held = self._held_of(child)
        bounds, counts = held.bounds, held.counts
        previous = first_at
        for at in times:
            counts[bisect_left(bounds, at - previous)] += 1
            previous = at
        held.total += times[-1] - first_at

    def _held_of(self, child: Any) -> _Held:
        held = self._held.get(child)
        if held is None:
            held = self._held[child] = _Held(upper_bounds(child))
        return held

    def flush(self) -> None:
        """Add the held updates to their series."""
        counts, self._counts = self._counts, {}
        held, self._held = self._held, {}
        for child, amount in counts.items():
            child.inc(amount)
        for child, h in held.items():
            add_counts(child, h.counts, h.total)


class AtOnce:
    """Every update to its series as it is made (multiprocess mode: to this process's files)."""

    __slots__ = ()

    @staticmethod
    def inc(child: Any, amount: float = 1) -> None:
        child.inc(amount)

    @staticmethod
    def observe(child: Any, value: float) -> None:
        child.observe(value)

    @staticmethod
    def observe_gaps(child: Any, first_at: float, times: Sequence[float]) -> None:
        observe_gaps(child, first_at, times)

    def flush(self) -> None:
        """Nothing is held."""


class FlushFirst(Collector):
    """Registered on the registry before the families: every collect adds what is held first."""

    def __init__(self, flush: Callable[[], None]) -> None:
        self._flush = flush

    def describe(self) -> Iterator[Metric]:
        return iter(())

    def collect(self) -> Iterator[Metric]:
        self._flush()
        return iter(())
