"""Worker.attempt_guard: in flight for the block, and exactly one breaker verdict per attempt."""

from __future__ import annotations

import pytest

from app.workers.breaker import BreakerState, CircuitBreaker
from app.workers.worker import Worker


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _worker(clock: Clock) -> Worker:
    return Worker("http://w1:30000", breaker=CircuitBreaker(failure_threshold=2, clock=clock))


def test_each_attempt_is_one_verdict_and_leaves_nothing_in_flight() -> None:
    worker = _worker(Clock())
    for _ in range(2):
        with worker.attempt_guard() as verdict:
            assert worker.in_flight == 1
            verdict.fault = True
    assert worker.in_flight == 0
    assert worker.breaker.state is BreakerState.OPEN  # two failures, threshold two


def test_an_answer_even_a_4xx_closes_the_streak() -> None:
    worker = _worker(Clock())
    with worker.attempt_guard() as verdict:
        verdict.fault = True
    with worker.attempt_guard() as verdict:
        verdict.fault = False
    with worker.attempt_guard() as verdict:
        verdict.fault = True
    assert worker.breaker.state is BreakerState.CLOSED  # the success reset the count


def test_no_verdict_frees_the_half_open_probe_slot() -> None:
    clock = Clock()
    worker = _worker(clock)
    for _ in range(2):
        with worker.attempt_guard() as verdict:
            verdict.fault = True
    clock.now += 60  # past open_s: half-open, one probe allowed
    assert worker.breaker.allows()
    probing: list[bool] = []

    def attempt() -> None:
        with worker.attempt_guard():
            probing.append(worker.breaker.allows())
            raise RuntimeError("the client left")

    with pytest.raises(RuntimeError):
        attempt()
    assert probing == [False]  # the probe was out while the attempt ran
    assert worker.breaker.allows() and worker.in_flight == 0
    assert worker.breaker.state is BreakerState.HALF_OPEN
