from __future__ import annotations

import pytest

from app.config import LimitsConfig
from app.errors import RateLimited
from app.limits import KeyLimits, LocalLimiter, RedisLimiter, TokenBucket, make_limiter
from tests.support.procs import free_port


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_token_bucket_allows_a_burst_then_refills_at_the_rate() -> None:
    clock = FakeClock()
    bucket = TokenBucket(rate_per_s=2.0, burst=3, clock=clock)
    assert [bucket.take() for _ in range(3)] == [0.0, 0.0, 0.0]
    assert bucket.take() == pytest.approx(0.5)
    clock.now += 0.5
    assert bucket.take() == 0.0
    assert bucket.take() > 0


async def test_local_rate_limit_gives_429_with_retry_after() -> None:
    clock = FakeClock()
    limiter = LocalLimiter(KeyLimits(rate_per_s=0.5, burst=1), clock=clock)
    async with limiter.hold("team-a"):
        pass
    with pytest.raises(RateLimited) as info:
        async with limiter.hold("team-a"):
            pass
    assert info.value.status == 429
    assert info.value.retry_after == 2
    async with limiter.hold("team-b"):  # keys are limited separately
        pass
    clock.now += 2
    async with limiter.hold("team-a"):
        pass


async def test_local_concurrency_limit_releases_on_exit_even_on_error() -> None:
    limiter = LocalLimiter(KeyLimits(max_concurrent=1))
    async with limiter.hold("k"):
        with pytest.raises(RateLimited):
            async with limiter.hold("k"):
                pass
    with pytest.raises(ValueError, match="boom"):
        async with limiter.hold("k"):
            raise ValueError("boom")
    async with limiter.hold("k"):
        pass


async def test_redis_limits_are_shared_between_replicas(redis_url: str) -> None:
    limits = KeyLimits(rate_per_s=0.01, burst=2, max_concurrent=1)
    first, second = RedisLimiter(redis_url, limits), RedisLimiter(redis_url, limits)
    try:
        async with first.hold("team-a"):
            with pytest.raises(RateLimited, match="concurrent"):
                async with second.hold("team-a"):
                    pass
        async with second.hold("team-a"):  # released by the first replica
            pass
        with pytest.raises(RateLimited, match="rate limit") as info:
            async with first.hold("team-a"):  # the burst of 2 is used up across both
                pass
        assert info.value.retry_after is not None
        assert info.value.retry_after >= 50
        async with first.hold("team-b"):
            pass
    finally:
        await first.close()
        await second.close()


async def test_redis_unreachable_lets_requests_through(caplog: pytest.LogCaptureFixture) -> None:
    port = free_port()  # nothing listens there
    limiter = RedisLimiter(
        f"redis://127.0.0.1:{port}/0", KeyLimits(rate_per_s=0.01, burst=1, max_concurrent=1)
    )
    try:
        for _ in range(3):  # over both limits, were they enforced
            async with limiter.hold("team-a"):
                pass
    finally:
        await limiter.close()
    assert "rate-limit store unavailable" in caplog.text


async def test_make_limiter_picks_the_backend() -> None:
    assert make_limiter(LimitsConfig()) is None
    assert isinstance(make_limiter(LimitsConfig(key_rate_per_s=1.0)), LocalLimiter)
    assert isinstance(make_limiter(LimitsConfig(key_max_concurrent=2)), LocalLimiter)
    shared = make_limiter(LimitsConfig(key_max_concurrent=2, redis_url="redis://127.0.0.1:1/0"))
    assert isinstance(shared, RedisLimiter)
    await shared.close()
