"""Token quotas per API key name: prompt + completion tokens per rolling minute
(``tokens_per_min``) and per UTC day (``tokens_per_day``), from each key's ``TenantPolicy``.

A request's tokens are known only when its answer ends, so a quota is checked before a request runs
and charged after: ``check`` refuses a key that is already at or over a quota (429, with
``Retry-After`` the seconds until the window has freed enough to be under it again), ``charge`` adds
the answer's tokens once it ended (estimated, ``app.proxy.unreported``, when the worker
reported none: a stream cut before its usage chunk, a whole answer the client hung up on, an answer
without ``usage``). Requests admitted while the key was under its quota all run to the end, so a key
can overshoot by what its requests in flight then use; the next ones wait the longer for it.

The minute is a sliding window of two fixed UTC minutes: the tokens used "in the last minute" are
this minute's plus the previous minute's weighted by the part of it still inside the window, so
a burst frees up gradually over the following minute rather than all at once on a boundary. The
day is the UTC calendar day: its count starts again at 00:00 UTC.

Two stores keep the counts behind one ``QuotaStore`` protocol: ``LocalStore`` in this process,
``RedisStore`` shared by every replica and process (one hash per key, updated atomically by a Lua
script on the Redis server's clock, expiring the day after its last charge). If Redis fails, the
request is admitted (fail open, like the request limits), the failure counted and logged at most
every few seconds (``app.limits.StoreErrors``), and its answer carries no tokens headers.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from app.limits.config import LimitsConfig
from app.limits.per_key import Budget, StoreErrors, redis_store
from app.tenants.config import TenantPolicy, TenantsConfig
from app.tenants.headers import duration

MINUTE_S = 60
DAY_S = 86400
Clock = Callable[[], float]


@dataclass(frozen=True, slots=True)
class Counts:
    """A key's tokens at ``now`` (seconds since the epoch): charged in this UTC minute, in the
    one before, and today (UTC)."""

    now: float
    minute: int = 0
    previous: int = 0
    day: int = 0

    @property
    def last_minute(self) -> float:
        """Tokens in the sliding minute ending now."""
        into = (self.now % MINUTE_S) / MINUTE_S
        return self.previous * (1.0 - into) + self.minute

    def minute_wait(self, limit: int) -> float:
        """Seconds until the last minute's tokens drop below ``limit`` (0: they are)."""
        if self.last_minute < limit:
            return 0.0
        into = self.now % MINUTE_S
        if self.minute < limit:  # the previous minute slides out far enough in this one
            frees_at = (1.0 - (limit - self.minute) / self.previous) * MINUTE_S
            return frees_at - into
        # Only once this minute is the previous one, and enough of it slid out.
        return MINUTE_S - into + (1.0 - limit / self.minute) * MINUTE_S

    def minute_reset(self) -> float:
        """Seconds until the sliding minute holds no tokens at all."""
        into = self.now % MINUTE_S
        if self.minute:
            return 2 * MINUTE_S - into
        return MINUTE_S - into if self.previous else 0.0

    def day_reset(self) -> float:
        """Seconds until 00:00 UTC."""
        return DAY_S - self.now % DAY_S


@dataclass(frozen=True, slots=True)
class Refusal:
    quota: str  # "tokens_per_min" or "tokens_per_day" (the rejections metric's label)
    retry_after: int  # seconds
    message: str


@dataclass(frozen=True, slots=True)
class QuotaState:
    """What a key's quotas allow now."""

    tokens: Budget | None  # the per-minute quota as the headers tell it; None: no such quota
    refusal: Refusal | None  # over a quota: why, and for how long


def assess(policy: TenantPolicy, counts: Counts) -> QuotaState:
    """The state of ``policy``'s quotas given the key's ``counts``. When both are exceeded the
    refusal names the one that frees later."""
    tokens: Budget | None = None
    refusals: list[Refusal] = []
    per_min, per_day = policy.tokens_per_min, policy.tokens_per_day
    if per_min is not None:
        used = counts.last_minute
        tokens = Budget(per_min, max(0, math.floor(per_min - used)), counts.minute_reset())
        if used >= per_min:
            after = int(counts.minute_wait(per_min)) + 1  # at that very instant it is still full
            refusals.append(
                Refusal(
                    "tokens_per_min",
                    after,
                    f"token quota of {per_min} tokens per minute exceeded for this API key "
                    f"({math.ceil(used)} used in the last minute); try again in {duration(after)}",
                )
            )
    if per_day is not None and counts.day >= per_day:
        reset = counts.day_reset()
        refusals.append(
            Refusal(
                "tokens_per_day",
                max(1, math.ceil(reset)),
                f"daily token quota of {per_day} tokens exceeded for this API key "
                f"({counts.day} used today); it resets at 00:00 UTC, in {duration(reset)}",
            )
        )
    refusal = max(refusals, key=lambda r: r.retry_after) if refusals else None
    return QuotaState(tokens, refusal)


def has_quota(policy: TenantPolicy) -> bool:
    return policy.tokens_per_min is not None or policy.tokens_per_day is not None


class QuotaStore(Protocol):
    async def counts(self, key: str, add: int = 0) -> Counts | None:
        """The key's counts after adding ``add`` tokens now; None when the store failed."""
        ...

    async def close(self) -> None: ...


class TokenQuotas:
    """The token quotas of every key, over one store."""

    def __init__(self, store: QuotaStore) -> None:
        self.store = store

    async def check(self, key: str, policy: TenantPolicy) -> QuotaState | None:
        """The key's quota state before a request; None when its policy has no quota or the
        store failed (the request is admitted)."""
        if not has_quota(policy):
            return None
        counts = await self.store.counts(key)
        return None if counts is None else assess(policy, counts)

    async def charge(self, key: str, policy: TenantPolicy, tokens: int) -> None:
        """Count an ended request's prompt + completion ``tokens`` against the key's quotas."""
        if tokens > 0 and has_quota(policy):
            await self.store.counts(key, tokens)

    async def close(self) -> None:
        await self.store.close()


def make_quotas(
    tenants: TenantsConfig,
    limits: LimitsConfig,
    *,
    clock: Clock = time.time,
    on_store_error: Callable[[], None] | None = None,
) -> TokenQuotas | None:
    """The quotas (shared through ``limits.redis_url`` when set); None when no policy has one."""
    if not any(has_quota(p) for p in (tenants.default, *tenants.keys.values())):
        return None
    if limits.redis_url:
        errors = StoreErrors("token-quota", on_store_error)
        return TokenQuotas(RedisStore(limits.redis_url, errors=errors))
    return TokenQuotas(LocalStore(clock))


class LocalStore:
    """Counts within this process (``clock``: seconds since the epoch)."""

    def __init__(self, clock: Clock = time.time) -> None:
        self._clock = clock
        # key -> [minute number, its tokens, the previous minute's, day number, its tokens]
        self._keys: dict[str, list[int]] = {}

    async def counts(self, key: str, add: int = 0) -> Counts | None:
        now = self._clock()
        minute, day = int(now // MINUTE_S), int(now // DAY_S)
        state = self._keys.get(key)
        if state is None:
            if not add:
                return Counts(now)
            state = self._keys[key] = [minute, 0, 0, day, 0]
        if state[0] != minute:
            state[2] = state[1] if state[0] == minute - 1 else 0
            state[0], state[1] = minute, 0
        if state[3] != day:
            state[3], state[4] = day, 0
        state[1] += add
        state[4] += add
        return Counts(now, state[1], state[2], state[4])

    async def close(self) -> None:
        pass


# KEYS[1] the key's hash; ARGV[1] tokens to add (0: only look). Returns {now in ms, this minute's
# tokens, the previous minute's, today's}.
_COUNTS_LUA = """
local time = redis.call('TIME')
local now = tonumber(time[1]) + tonumber(time[2]) / 1e6
local minute, day = math.floor(now / 60), math.floor(now / 86400)
local s = redis.call('HMGET', KEYS[1], 'm', 'cur', 'prev', 'd', 'day')
local cur, prev, today = tonumber(s[2]) or 0, tonumber(s[3]) or 0, tonumber(s[5]) or 0
if tonumber(s[1]) ~= minute then
  if tonumber(s[1]) == minute - 1 then prev = cur else prev = 0 end
  cur = 0
end
if tonumber(s[4]) ~= day then today = 0 end
local add = tonumber(ARGV[1])
if add > 0 then
  cur, today = cur + add, today + add
  redis.call('HSET', KEYS[1], 'm', minute, 'cur', cur, 'prev', prev, 'd', day, 'day', today)
  redis.call('PEXPIRE', KEYS[1], math.ceil(((day + 1) * 86400 - now + 120) * 1000))
end
return {tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000), cur, prev, today}
"""


class RedisStore:
    """Counts shared by every gateway replica and process through one Redis, on its clock. Each
    call is bounded by ``timeout_s``; a failure is reported to ``errors`` and answered None."""

    def __init__(
        self,
        url: str,
        *,
        prefix: str = "dflash-gateway",
        timeout_s: float = 0.5,
        errors: StoreErrors | None = None,
    ) -> None:
        self._redis, self._errors = redis_store(url, timeout_s)
        self._report = errors or StoreErrors("token-quota")
        self._prefix = prefix
        self._script = self._redis.register_script(_COUNTS_LUA)

    async def counts(self, key: str, add: int = 0) -> Counts | None:
        try:
            now_ms, minute, previous, day = await self._script(
                keys=[f"{self._prefix}:quota:{key}"], args=[add]
            )
        except self._errors as exc:
            self._report("charge" if add else "check", exc)
            return None
        return Counts(int(now_ms) / 1000, int(minute), int(previous), int(day))

    async def close(self) -> None:
        await self._redis.aclose()
