"""Routing policies: one synchronous, I/O-free ``pick(ctx, workers) -> Worker`` each.

``workers`` is never empty: the caller passes the candidates that may take the request now
(routable, serving the model, under their admission cap, not already tried for this request).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from app.workers.worker import Worker


@dataclass(frozen=True, slots=True)
class RoutingContext:
    model: str
    # prefix_affinity's key: X-Session-Id, else the request's `user`, else a conversation hash.
    routing_key: str | None = None


class Policy(Protocol):
    name: str

    def pick(self, ctx: RoutingContext, workers: Sequence[Worker]) -> Worker: ...


class LeastInflight:
    """Fewest in-flight requests through this gateway; ties broken by the worker's polled load."""

    name = "least_inflight"

    def pick(self, ctx: RoutingContext, workers: Sequence[Worker]) -> Worker:
        return min(workers, key=lambda w: (w.in_flight, w.load.running + w.load.waiting, w.name))
