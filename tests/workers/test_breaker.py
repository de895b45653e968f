from __future__ import annotations

from app.workers.breaker import BreakerState, CircuitBreaker


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _breaker(clock: FakeClock) -> CircuitBreaker:
    return CircuitBreaker(failure_threshold=3, open_s=10.0, clock=clock)


def test_opens_after_consecutive_failures_only() -> None:
    clock = FakeClock()
    breaker = _breaker(clock)
    breaker.on_failure()
    breaker.on_failure()
    breaker.on_success()  # resets the streak
    breaker.on_failure()
    breaker.on_failure()
    assert breaker.state is BreakerState.CLOSED
    breaker.on_failure()
    assert breaker.state is BreakerState.OPEN
    assert not breaker.allows()


def test_half_open_admits_one_probe_then_closes_on_success() -> None:
    clock = FakeClock()
    breaker = _breaker(clock)
    for _ in range(3):
        breaker.on_failure()
    clock.now += 9.9
    assert breaker.state is BreakerState.OPEN
    clock.now += 0.2
    assert breaker.state is BreakerState.HALF_OPEN
    assert breaker.allows()
    breaker.on_attempt()
    assert not breaker.allows()  # only one probe at a time
    breaker.on_success()
    assert breaker.state is BreakerState.CLOSED
    assert breaker.allows()


def test_failed_probe_reopens_for_a_full_period() -> None:
    clock = FakeClock()
    breaker = _breaker(clock)
    for _ in range(3):
        breaker.on_failure()
    clock.now += 10
    breaker.on_attempt()
    breaker.on_failure()
    assert breaker.state is BreakerState.OPEN
    clock.now += 9
    assert not breaker.allows()
    clock.now += 1
    assert breaker.allows()


def test_released_probe_frees_the_slot() -> None:
    clock = FakeClock()
    breaker = _breaker(clock)
    for _ in range(3):
        breaker.on_failure()
    clock.now += 10
    breaker.on_attempt()
    breaker.on_released()
    assert breaker.allows()
