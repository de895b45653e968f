"""Token quotas over an injected clock (seconds since the epoch): the sliding minute, the UTC day,
refusals and their Retry-After; then the same quotas shared through a real redis-server."""

from __future__ import annotations

import logging

import pytest

from app.limits.config import LimitsConfig
from app.tenants.config import TenantPolicy, TenantsConfig
from app.tenants.quota import LocalStore, RedisStore, TokenQuotas, make_quotas
from tests.support.procs import free_port

MINUTE = 1_767_225_600  # 2026-01-01T00:00:00Z: a UTC minute and day start here
PER_MIN = TenantPolicy(tokens_per_min=100)


class Clock:
    def __init__(self, now: float = MINUTE) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def _quotas(clock: Clock) -> TokenQuotas:
    return TokenQuotas(LocalStore(clock))


async def _refused(quotas: TokenQuotas, policy: TenantPolicy, key: str = "team-a") -> int | None:
    """The Retry-After of a refusal now, or None when the key is admitted."""
    state = await quotas.check(key, policy)
    assert state is not None
    return None if state.refusal is None else state.refusal.retry_after


async def test_the_minute_slides_rather_than_resetting_on_the_boundary() -> None:
    clock = Clock(MINUTE + 10)
    quotas = _quotas(clock)
    await quotas.charge("team-a", PER_MIN, 90)
    clock.now = MINUTE + 59
    state = await quotas.check("team-a", PER_MIN)
    assert state is not None and state.refusal is None
    assert state.tokens is not None and state.tokens.remaining == 10
    clock.now = MINUTE + 60  # a new UTC minute: the 90 still count, sliding out over it
    await quotas.charge("team-a", PER_MIN, 30)
    # 90 * (1 - 0/60) + 30 = 120 >= 100: under it again once 90 * (1 - x/60) + 30 < 100,
    # x > 13.3 s.
    assert await _refused(quotas, PER_MIN) == 14
    clock.now = MINUTE + 60 + 13
    assert await _refused(quotas, PER_MIN) is not None
    clock.now = MINUTE + 60 + 14
    assert await _refused(quotas, PER_MIN) is None
    state = await quotas.check("team-a", PER_MIN)
    assert state is not None and state.tokens is not None
    assert state.tokens.remaining == 1  # 100 - (69 + 30)


async def test_an_overshoot_frees_only_as_its_minute_slides_out() -> None:
    clock = Clock(MINUTE + 10)
    quotas = _quotas(clock)
    await quotas.charge("team-a", PER_MIN, 150)  # one long answer, admitted while under
    clock.now = MINUTE + 20
    state = await quotas.check("team-a", PER_MIN)
    assert state is not None and state.refusal is not None
    assert state.refusal.quota == "tokens_per_min"
    # 150 * (1 - x/60) < 100 in the next minute: x > 20 s, i.e. 40 + 20 s from now.
    assert state.refusal.retry_after == 61
    assert "100 tokens per minute" in state.refusal.message
    assert "1m1s" in state.refusal.message
    assert state.tokens is not None
    assert (state.tokens.remaining, state.tokens.reset_s) == (0, 100)  # empty at 2 minutes
    clock.now = MINUTE + 80
    assert await _refused(quotas, PER_MIN) is not None  # exactly at the quota: still refused
    clock.now = MINUTE + 81
    assert await _refused(quotas, PER_MIN) is None
    clock.now = MINUTE + 120  # two minutes on, nothing is left of it
    state = await quotas.check("team-a", PER_MIN)
    assert state is not None and state.tokens is not None
    assert (state.tokens.remaining, state.tokens.reset_s) == (100, 0)


async def test_the_daily_budget_starts_again_at_utc_midnight() -> None:
    daily = TenantPolicy(tokens_per_day=1000)
    clock = Clock(MINUTE + 3600)  # 01:00 UTC
    quotas = _quotas(clock)
    await quotas.charge("team-a", daily, 600)
    clock.now = MINUTE + 86400 - 7200  # 22:00 UTC
    await quotas.charge("team-a", daily, 400)
    clock.now = MINUTE + 86400 - 60  # 23:59 UTC
    state = await quotas.check("team-a", daily)
    assert state is not None and state.refusal is not None
    assert state.refusal.quota == "tokens_per_day"
    assert state.refusal.retry_after == 60
    assert "00:00 UTC" in state.refusal.message
    assert state.tokens is None  # no per-minute quota: no tokens headers
    clock.now = MINUTE + 86400  # midnight
    assert await _refused(quotas, daily) is None
    await quotas.charge("team-a", daily, 999)
    assert await _refused(quotas, daily) is None
    await quotas.charge("team-a", daily, 1)
    assert await _refused(quotas, daily) == 86400


async def test_over_both_quotas_the_refusal_names_the_one_that_frees_later() -> None:
    both = TenantPolicy(tokens_per_min=100, tokens_per_day=150)
    clock = Clock(MINUTE + 5)
    quotas = _quotas(clock)
    await quotas.charge("team-a", both, 160)
    state = await quotas.check("team-a", both)
    assert state is not None and state.refusal is not None
    assert state.refusal.quota == "tokens_per_day"


async def test_keys_are_separate_and_a_key_without_a_quota_is_not_tracked() -> None:
    clock = Clock()
    quotas = _quotas(clock)
    await quotas.charge("team-a", PER_MIN, 500)
    assert await _refused(quotas, PER_MIN, "team-a") is not None
    assert await _refused(quotas, PER_MIN, "team-b") is None
    free = TenantPolicy()
    await quotas.charge("team-c", free, 10**9)
    assert await quotas.check("team-c", free) is None
    assert await _refused(quotas, PER_MIN, "team-c") is None


async def test_make_quotas_picks_the_store() -> None:
    assert make_quotas(TenantsConfig(), LimitsConfig()) is None
    tenants = TenantsConfig(keys={"team-a": TenantPolicy(tokens_per_day=10)})
    local = make_quotas(tenants, LimitsConfig())
    assert local is not None and isinstance(local.store, LocalStore)
    shared = make_quotas(tenants, LimitsConfig(redis_url="redis://127.0.0.1:1/0"))
    assert shared is not None and isinstance(shared.store, RedisStore)
    await shared.close()


async def test_redis_shares_the_quota_between_replicas(redis_url: str) -> None:
    first, second = TokenQuotas(RedisStore(redis_url)), TokenQuotas(RedisStore(redis_url))
    try:
        assert await _refused(second, PER_MIN) is None
        await first.charge("team-a", PER_MIN, 60)
        state = await second.check("team-a", PER_MIN)
        assert state is not None and state.tokens is not None
        assert state.refusal is None and state.tokens.remaining <= 40
        await second.charge("team-a", PER_MIN, 60)
        retry_after = await _refused(first, PER_MIN)
        assert retry_after is not None and 1 <= retry_after <= 121
        assert await _refused(first, PER_MIN, "team-b") is None
        daily = TenantPolicy(tokens_per_day=100)
        await first.charge("team-d", daily, 100)
        assert await _refused(second, daily, "team-d") is not None
    finally:
        await first.close()
        await second.close()


async def test_redis_unreachable_admits_and_counts_each_failure(
    caplog: pytest.LogCaptureFixture,
) -> None:
    failures: list[int] = []
    quotas = make_quotas(
        TenantsConfig(default=PER_MIN),
        LimitsConfig(redis_url=f"redis://127.0.0.1:{free_port()}/0"),  # nothing listens there
        on_store_error=lambda: failures.append(1),
    )
    assert quotas is not None
    try:
        with caplog.at_level(logging.WARNING):
            for _ in range(3):
                assert await quotas.check("team-a", PER_MIN) is None  # admitted, no headers
                await quotas.charge("team-a", PER_MIN, 10**6)
    finally:
        await quotas.close()
    assert len(failures) == 6
    lines = [r for r in caplog.records if "token-quota store unavailable" in r.getMessage()]
    assert len(lines) == 1  # not one line per request
