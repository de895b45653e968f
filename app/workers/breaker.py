"""Passive circuit breaker fed by request outcomes (clock injected).

    CLOSED ──N consecutive failures──▶ OPEN ──open_s elapsed──▶ HALF_OPEN
       ▲                                 ▲                          │ one probe request
       └───────────── probe succeeds ────┼──────────────────────────┤
                                         └────── probe fails ───────┘

The numeric values are what ``dflash_gateway_worker_breaker_state`` exports.

One client cannot open a breaker for everyone. A worker that answers with an error status is up
and reading requests, and whether the error was the request's doing cannot be told from the
answer: SGLang answers 500 ("Internal server error: ...") when turning a request into its own
form raises, e.g. a chat template that fails on the request's messages. So such a failure is
attributed to the API key of the request (``on_failure(source=key)``), and within one run of
consecutive failures each key counts at most ``failure_threshold - 1`` times: ten bad requests
from one key leave the breaker closed (and every other key served), while a worker that fails
the requests of two or more keys opens as before. Failures that say nothing about the request
(the worker refused the connection, went silent, broke its answer off) and requests without a
key (a gateway with no keys cannot tell its clients apart) count in full. A worker that fails
every request of a gateway with a single key is left to the active health checks, which find an
engine that cannot generate. With ``failure_threshold`` 1 any failure opens it.
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
        # This run's failures by the API key they were attributed to (see the module doc).
        self._by_source: dict[str, int] = {}
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
        self._by_source.clear()
        self._opened_at = None
        self._probe_in_flight = False

    def on_failure(self, source: str | None = None) -> None:
        """A failed request; ``source``: the API key it is attributed to (None: the worker's
        failure whoever sent it)."""
        self._probe_in_flight = False
        if self.state is BreakerState.HALF_OPEN:
            self._opened_at = self._clock()
            return
        if source is not None:
            count = self._by_source.get(source, 0) + 1
            self._by_source[source] = count
            if count >= self._threshold > 1:  # past one key's share of the run
                return
        self._failures += 1
        if self._failures >= self._threshold and self._opened_at is None:
            self._opened_at = self._clock()
            self._by_source.clear()

    def on_released(self) -> None:
        """A request ended with neither verdict (e.g. the client left): free the probe slot."""
        self._probe_in_flight = False
