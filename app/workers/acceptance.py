"""Acceptance-collapse detection: a worker whose acceptance length falls far below its peers'.

DFlash output per verify step is the acceptance length; a drafter that no longer matches its
target (a bad rollout) drops it to ~1-1.5 tokens per step while the worker stays healthy. Each
answered request with a per-request figure (exact from ``meta_info``, or estimated from the
stream's chunks) updates its worker's EWMA once (``observe``, called when the request is
recorded). A worker with at least ``min_samples`` requests is *collapsed* when its EWMA is below
``collapse_ratio`` x the median EWMA of its peers that also have ``min_samples``; it clears at
``collapse_clear_ratio`` x that median. Without a qualified peer nothing is judged (one worker
cannot be compared with anything). A worker that (re)becomes healthy starts afresh
(``Acceptance.reset``: a restarted or rolled-back pod).

Comparing with peers rather than with a fixed baseline keeps a fleet-wide change of traffic
(more chat, less maths) from flagging anyone; it assumes peers see similar traffic, which load
policies give and ``prefix_affinity`` with skewed sessions may not.

Each process judges from its own requests (``--processes N``): the flag may differ per process for
a while; the gauge takes the largest (any process that sees the collapse reports it).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Protocol

from app.workers.worker import Worker


class CollapseSettings(Protocol):
    """The detector's settings (``routing.*``, ``app.routing.config.RoutingConfig``)."""

    @property
    def collapse_ratio(self) -> float: ...

    @property
    def collapse_clear_ratio(self) -> float: ...

    @property
    def collapse_min_samples(self) -> int: ...

    @property
    def collapse_ewma_alpha(self) -> float: ...


class CollapseDetector:
    def __init__(self, config: CollapseSettings, workers: Callable[[], Iterable[Worker]]) -> None:
        self._config = config
        self._workers = workers

    def observe(self, worker: Worker, accept_length: float) -> None:
        """One request's acceptance length on ``worker``; re-judges the fleet."""
        track = worker.accept
        alpha = self._config.collapse_ewma_alpha
        if track.ewma is None:
            track.ewma = accept_length
        else:
            track.ewma += alpha * (accept_length - track.ewma)
        track.samples += 1
        if track.samples >= self._config.collapse_min_samples:
            self.judge(self._workers())

    def judge(self, workers: Iterable[Worker]) -> None:
        """Set every qualified worker's ``collapsed`` flag against the median of its peers.

        O(n log n) in the workers; each worker's peer median comes from one sorted list."""
        config = self._config
        qualified = sorted(
            (w for w in workers if w.accept.samples >= config.collapse_min_samples),
            key=_ewma,
        )
        peers = len(qualified) - 1
        if peers < 1:
            for w in qualified:
                w.accept.collapsed = False
            return
        values = [_ewma(w) for w in qualified]
        for i, w in enumerate(qualified):
            median = _median_without(values, i)
            ratio = config.collapse_clear_ratio if w.accept.collapsed else config.collapse_ratio
            w.accept.collapsed = values[i] < ratio * median


def _ewma(worker: Worker) -> float:
    return worker.accept.ewma or 0.0


def _median_without(values: list[float], skip: int) -> float:
    """Median of the sorted ``values`` with the one at index ``skip`` left out."""
    n = len(values) - 1

    def at(j: int) -> float:
        return values[j if j < skip else j + 1]

    return (at((n - 1) // 2) + at(n // 2)) / 2
