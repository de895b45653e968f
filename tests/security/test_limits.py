from __future__ import annotations

import asyncio
import logging
import signal

import pytest

from app.errors import RateLimited
from app.limits.config import LimitsConfig
from app.limits.per_key import (
    Budget,
    KeyLimits,
    LocalLimiter,
    RedisLimiter,
    StoreErrors,
    TokenBucket,
    make_limiter,
)
from tests.support.procs import PYTHON, free_port
from tests.support.tools import ROOT


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


async def test_hold_tells_the_request_rate_per_minute_and_what_is_left() -> None:
    clock = FakeClock()
    limiter = LocalLimiter(KeyLimits(rate_per_s=1.0, burst=3), clock=clock)
    async with limiter.hold("team-a") as budget:
        assert budget == Budget(limit=60, remaining=2, reset_s=1.0)
    async with limiter.hold("team-a"), limiter.hold("team-a") as budget:
        assert (budget.remaining, budget.reset_s) == (0, 3.0)
    with pytest.raises(RateLimited) as info:
        async with limiter.hold("team-a"):
            pass
    assert info.value.budget == Budget(limit=60, remaining=0, reset_s=3.0)
    async with LocalLimiter(KeyLimits(max_concurrent=1)).hold("team-a") as budget:
        assert budget is None  # no request rate limit: nothing to tell


async def test_redis_hold_tells_the_shared_budget(redis_url: str) -> None:
    limits = KeyLimits(rate_per_s=0.01, burst=2, max_concurrent=1)
    first, second = RedisLimiter(redis_url, limits), RedisLimiter(redis_url, limits)
    try:
        async with first.hold("team-a") as budget:
            assert budget is not None
            assert (budget.limit, budget.remaining) == (1, 1)  # 0.6/min told as 1/min
            with pytest.raises(RateLimited, match="concurrent") as info:
                async with second.hold("team-a"):
                    pass
            assert info.value.budget is not None and info.value.budget.remaining == 1
        async with second.hold("team-a") as budget:
            assert budget is not None and budget.remaining == 0
            assert 190 < budget.reset_s <= 200  # two tokens at 0.01/s
    finally:
        await first.close()
        await second.close()


async def test_store_errors_are_counted_each_and_logged_once_a_while(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = FakeClock()
    counted: list[int] = []
    errors = StoreErrors("rate-limit", lambda: counted.append(1), every_s=10, clock=clock)
    with caplog.at_level(logging.WARNING):
        for _ in range(5):
            errors("bucket", ConnectionError("refused"))
        clock.now += 10
        errors("bucket", ConnectionError("refused"))
    assert len(counted) == 6
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2
    assert "5 failure(s)" in lines[1]


_HOLDER = """
import asyncio, sys
from app.limits.per_key import KeyLimits, RedisLimiter

async def main():
    limiter = RedisLimiter(sys.argv[1], KeyLimits(max_concurrent=2), lease_ttl_s=1.0)
    async with limiter.hold("team-a"):
        print("held", flush=True)
        await asyncio.Event().wait()

asyncio.run(main())
"""


async def test_a_killed_replicas_slot_expires_while_the_key_stays_busy(redis_url: str) -> None:
    """A replica SIGKILLed with a request in flight never releases its slot; the slot's lease
    expires on its own (here after 1 s) even though the key's other requests keep coming."""
    holder = await asyncio.create_subprocess_exec(
        PYTHON, "-c", _HOLDER, redis_url, stdout=asyncio.subprocess.PIPE, cwd=ROOT
    )
    assert holder.stdout is not None
    assert await asyncio.wait_for(holder.stdout.readline(), 20) == b"held\n"
    holder.send_signal(signal.SIGKILL)
    await holder.wait()
    live = RedisLimiter(redis_url, KeyLimits(max_concurrent=2), lease_ttl_s=1.0)
    try:
        with pytest.raises(RateLimited, match="concurrent"):  # the dead replica's slot counts
            async with live.hold("team-a"), live.hold("team-a"):
                pass
        loop = asyncio.get_running_loop()
        busy_until = loop.time() + 2.5
        while loop.time() < busy_until:  # the key in regular use, one request at a time
            async with live.hold("team-a"):
                await asyncio.sleep(0.02)
        async with live.hold("team-a"), live.hold("team-a"):  # both slots free again
            pass
    finally:
        await live.close()


async def test_a_request_longer_than_the_lease_keeps_its_slot(redis_url: str) -> None:
    limits = KeyLimits(max_concurrent=1)
    first = RedisLimiter(redis_url, limits, lease_ttl_s=0.6)
    second = RedisLimiter(redis_url, limits, lease_ttl_s=0.6)
    try:
        async with first.hold("team-a"):
            for _ in range(10):  # 2 s: more than three lease periods
                with pytest.raises(RateLimited, match="concurrent"):
                    async with second.hold("team-a"):
                        pass
                await asyncio.sleep(0.2)
        async with second.hold("team-a"):  # released at once when it ended
            pass
    finally:
        await first.close()
        await second.close()
