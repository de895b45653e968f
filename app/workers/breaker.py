"""Passive circuit breaker fed by request outcomes (clock injected).

    CLOSED ──N consecutive failures──▶ OPEN ──open_s elapsed──▶ HALF_OPEN
       ▲                                 ▲                          │ one probe request
       └───────────── probe succeeds ────┼──────────────────────────┤
                                         └────── probe fails ───────┘

The numeric values are what ``dflash_gateway_worker_breaker_state`` exports.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable


class BreakerState(enum.IntEnum):
    CLOSED = 0
    OPEN = 1
    HALF_OPEN = 2


class CircuitBreaker:
    def __init__(
        self,
        *,
        failure_threshold: int = 5,
        open_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._threshold = failure_threshold
        self._open_s = open_s
        self._clock = clock
        self._failures = 0
        self._opened_at: float | None = None
        self._probe_in_flight = False

    @property
    def state(self) -> BreakerState:
        if self._opened_at is None:
            return BreakerState.CLOSED
        if self._clock() - self._opened_at >= self._open_s:
            return BreakerState.HALF_OPEN
        return BreakerState.OPEN

    def allows(self) -> bool:
        """May a request go to this worker now? (Does not claim the half-open probe.)"""
        state = self.state
        return state is BreakerState.CLOSED or (
            state is BreakerState.HALF_OPEN and not self._probe_in_flight
        )

    def on_attempt(self) -> None:
        """A request was sent; in half-open it is the single probe."""
        if self.state is BreakerState.HALF_OPEN:
            self._probe_in_flight = True

    def on_success(self) -> None:
        self._failures = 0
        self._opened_at = None
        self._probe_in_flight = False

    def on_failure(self) -> None:
        self._probe_in_flight = False
        if self.state is BreakerState.HALF_OPEN:
            self._opened_at = self._clock()
            return
        self._failures += 1
        if self._failures >= self._threshold and self._opened_at is None:
            self._opened_at = self._clock()

    def on_released(self) -> None:
        """A request ended with neither verdict (e.g. the client left): free the probe slot."""
        self._probe_in_flight = False
