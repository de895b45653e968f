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


def test_one_keys_failures_alone_never_open_it() -> None:
    breaker = _breaker(FakeClock())
    for _ in range(10):
        breaker.on_failure(source="a")
    assert breaker.state is BreakerState.CLOSED


def test_failures_of_two_keys_open_it() -> None:
    breaker = _breaker(FakeClock())
    for _ in range(5):
        breaker.on_failure(source="a")  # two of these count (threshold 3)
    assert breaker.state is BreakerState.CLOSED
    breaker.on_failure(source="b")
    assert breaker.state is BreakerState.OPEN


def test_unattributed_failures_count_in_full_and_a_success_resets_the_shares() -> None:
    breaker = _breaker(FakeClock())
    breaker.on_failure(source="a")
    breaker.on_failure(source="a")
    breaker.on_failure()  # a refused connection, a request without a key: the worker's
    assert breaker.state is BreakerState.OPEN
    breaker = _breaker(FakeClock())
    breaker.on_failure(source="a")
    breaker.on_failure(source="a")  # a's share used up
    breaker.on_success()
    breaker.on_failure(source="a")
    breaker.on_failure(source="a")
    breaker.on_failure(source="b")
    assert breaker.state is BreakerState.OPEN  # a's share counted again after the success


def test_with_a_threshold_of_one_any_failure_opens_it() -> None:
    breaker = CircuitBreaker(failure_threshold=1, open_s=10.0, clock=FakeClock())
    breaker.on_failure(source="a")
    assert breaker.state is BreakerState.OPEN
