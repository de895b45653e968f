"""Per-key request-rate and concurrent-request limits.

A token bucket per key name (``rate_per_s`` sustained, ``burst`` at once) and a cap on requests in
flight per key. Over either limit the request is refused with 429 + ``Retry-After`` (the only 429
the gateway sends, with the token quotas of ``app.tenants.quota``; see docs/contracts.md). ``hold``
gives the request rate's ``Budget`` for the rate-limit headers (``app.tenants.headers``): the
rate per minute, the whole requests left in the bucket, and the seconds until it is full. The
in-process backend limits each gateway process on its own; the Redis backend shares the limits
across gateway replicas and processes, with the bucket updated atomically in a Lua script on the
Redis server's clock, and the requests in flight counted as leases that expire unless renewed
(a replica that dies holding some leaks them only briefly). If Redis cannot be reached the
request is let through: a limiter outage must not become a gateway outage. ``StoreErrors``
counts each such failure and logs them at most every few seconds, not once per request.

``make_limiter`` picks the backend from ``LimitsConfig``; None when no per-key limit is set.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import secrets
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, Protocol

from app.errors import RateLimited
from app.limits.config import LimitsConfig

log = logging.getLogger(__name__)
Clock = Callable[[], float]


@dataclass(frozen=True, slots=True)
class Budget:
    """One limit as the headers tell it: its size, what is left of it, and the seconds until it
    is whole again."""

    limit: int
    remaining: int
    reset_s: float


@dataclass(frozen=True, slots=True)
class KeyLimits:
    rate_per_s: float | None = None  # None: no rate limit
    burst: int = 10
    max_concurrent: int | None = None  # None: no concurrency limit

    def budget(self, tokens: float) -> Budget:
        """The request rate as the headers tell it, with ``tokens`` left in the key's bucket:
        the limit per minute, whole requests left (at most the limit) and the seconds until the
        bucket is full."""
        assert self.rate_per_s is not None
        limit = max(1, round(self.rate_per_s * 60))
        reset_s = max(0.0, (self.burst - tokens) / self.rate_per_s)
        return Budget(limit, min(limit, max(0, int(tokens))), reset_s)


class Limiter(Protocol):
    def hold(self, key: str) -> Any:
        """``async with limiter.hold(key) as budget:`` for the whole request; ``budget``: the
        request rate's ``Budget`` (None without a rate limit, or when the store failed). Raises
        ``RateLimited``, its ``budget`` set when the key has a rate limit."""
        ...

    async def close(self) -> None: ...


class StoreErrors:
    """Failures of a shared limit store: each one counted (``count``), and logged at most once
    every ``every_s`` seconds with how many there were since, so an outage under load does not
    write a log line per request."""

    def __init__(
        self,
        what: str,
        count: Callable[[], None] | None = None,
        *,
        every_s: float = 10.0,
        clock: Clock = time.monotonic,
    ) -> None:
        self._what = what
        self._count = count
        self._every_s = every_s
        self._clock = clock
        self._logged_at: float | None = None
        self._unlogged = 0

    def __call__(self, op: str, exc: BaseException) -> None:
        if self._count is not None:
            self._count()
        self._unlogged += 1
        now = self._clock()
        if self._logged_at is not None and now - self._logged_at < self._every_s:
            return
        log.warning(
            "%s store unavailable (%s: %s); not limiting (%d failure(s) since the last report)",
            self._what,
            op,
            exc,
            self._unlogged,
        )
        self._logged_at, self._unlogged = now, 0


def make_limiter(
    config: LimitsConfig,
    clock: Clock = time.monotonic,
    *,
    on_store_error: Callable[[], None] | None = None,
) -> Limiter | None:
    """The per-key limiter (None without limits); ``on_store_error`` counts a Redis failure."""
    limits = KeyLimits(
        rate_per_s=config.key_rate_per_s,
        burst=config.key_burst,
        max_concurrent=config.key_max_concurrent,
    )
    if limits.rate_per_s is None and limits.max_concurrent is None:
        return None
    if config.redis_url:
        return RedisLimiter(
            config.redis_url, limits, errors=StoreErrors("rate-limit", on_store_error)
        )
    return LocalLimiter(limits, clock)


class TokenBucket:
    def __init__(self, rate_per_s: float, burst: int, clock: Clock) -> None:
        self._rate = rate_per_s
        self._burst = float(burst)
        self._clock = clock
        self._tokens = float(burst)
        self._stamp = clock()

    def level(self) -> float:
        """The tokens in the bucket now."""
        now = self._clock()
        self._tokens = min(self._burst, self._tokens + (now - self._stamp) * self._rate)
        self._stamp = now
        return self._tokens

    def take(self) -> float:
        """Take one token: 0.0 when granted, else the seconds until one is available."""
        if self.level() >= 1.0:
            self._tokens -= 1.0
            return 0.0
        return (1.0 - self._tokens) / self._rate


def _refuse(wait_s: float, why: str, budget: Budget | None = None) -> RateLimited:
    refused = RateLimited(why, retry_after=max(1, math.ceil(wait_s)))
    refused.budget = budget
    return refused


class LocalLimiter:
    """Limits within this process."""

    def __init__(self, limits: KeyLimits, clock: Clock = time.monotonic) -> None:
        self._limits = limits
        self._clock = clock
        self._buckets: dict[str, TokenBucket] = {}
        self._in_flight: dict[str, int] = {}

    async def close(self) -> None:
        pass

    def _bucket(self, key: str, rate_per_s: float) -> TokenBucket:
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = TokenBucket(rate_per_s, self._limits.burst, self._clock)
        return bucket

    @asynccontextmanager
    async def hold(self, key: str) -> AsyncIterator[Budget | None]:
        limits = self._limits
        rate = limits.rate_per_s
        if limits.max_concurrent is not None and (
            self._in_flight.get(key, 0) >= limits.max_concurrent
        ):
            budget = None if rate is None else limits.budget(self._bucket(key, rate).level())
            raise _refuse(
                1.0,
                f"too many concurrent requests for this API key (limit {limits.max_concurrent})",
                budget,
            )
        budget = None
        if rate is not None:
            bucket = self._bucket(key, rate)
            wait = bucket.take()
            budget = limits.budget(bucket.level())
            if wait:
                raise _refuse(
                    wait, f"rate limit of {rate:g} requests/s exceeded for this API key", budget
                )
        self._in_flight[key] = self._in_flight.get(key, 0) + 1
        try:
            yield budget
        finally:
            self._in_flight[key] -= 1


# KEYS[1] bucket hash; ARGV rate, burst, 1 to take a token (0: only look). Returns {0 when granted,
# else milliseconds to wait; thousandths of a token left}.
_BUCKET_LUA = """
local now = redis.call('TIME')
local t = tonumber(now[1]) + tonumber(now[2]) / 1e6
local rate, burst, take = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local state = redis.call('HMGET', KEYS[1], 'tokens', 'stamp')
local tokens = tonumber(state[1]) or burst
local stamp = tonumber(state[2]) or t
tokens = math.min(burst, tokens + (t - stamp) * rate)
local wait = 0
if take == 0 then return {0, math.floor(tokens * 1000)} end
if tokens >= 1 then tokens = tokens - 1 else wait = math.ceil((1 - tokens) / rate * 1000) end
redis.call('HSET', KEYS[1], 'tokens', tokens, 'stamp', t)
redis.call('PEXPIRE', KEYS[1], math.ceil(burst / rate * 1000) + 1000)
return {wait, math.floor(tokens * 1000)}
"""

# Concurrency leases: KEYS[1] a sorted set of lease ids scored by their expiry (ms since the
# epoch, on the Redis server's clock). The set itself expires with its last lease.
# Acquire: ARGV limit, ttl ms, lease id. Expired leases are dropped before counting. Returns 1
# when admitted (the lease added), 0 when the key already holds ``limit`` live leases.
_ACQUIRE_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[1]) then return 0 end
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[3])
local last = redis.call('ZRANGE', KEYS[1], -1, -1, 'WITHSCORES')
redis.call('PEXPIREAT', KEYS[1], last[2])
return 1
"""
# Renew: ARGV ttl ms, then the lease ids this replica holds; each one still there expires ttl
# from now (one that already expired is not brought back). Returns how many were renewed.
_RENEW_LUA = """
local t = redis.call('TIME')
local expiry = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) + tonumber(ARGV[1])
local renewed = 0
for i = 2, #ARGV do
  renewed = renewed + redis.call('ZADD', KEYS[1], 'XX', 'CH', expiry, ARGV[i])
end
local last = redis.call('ZRANGE', KEYS[1], -1, -1, 'WITHSCORES')
if last[2] then redis.call('PEXPIREAT', KEYS[1], last[2]) end
return renewed
"""


def redis_store(url: str, timeout_s: float) -> tuple[Any, tuple[type[Exception], ...]]:
    """A Redis client (imported only when a limit store is configured) whose every call is
    bounded by ``timeout_s``, and the errors its calls raise when the store is unavailable."""
    import redis.asyncio as redis
    from redis.exceptions import RedisError

    client = redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
    return client, (RedisError, OSError)


class RedisLimiter:
    """Limits shared by every gateway replica through one Redis. Each request in flight holds a
    lease of its own in the key's sorted set (``inflight:<key>``), scored by when it expires:
    ``lease_ttl_s`` after it was taken, pushed on every ``lease_ttl_s / 3`` while the request
    runs (one Redis call per key for all of this process's leases). The slot count is the
    leases not yet expired, so a replica killed with requests in flight leaks their slots for
    ``lease_ttl_s`` at most, however busy the key stays. Every Redis call is bounded by
    ``timeout_s``; on any Redis error the request is admitted (and the failure reported to
    ``errors``)."""

    def __init__(
        self,
        url: str,
        limits: KeyLimits,
        *,
        prefix: str = "dflash-gateway",
        lease_ttl_s: float = 60.0,
        timeout_s: float = 0.5,
        errors: StoreErrors | None = None,
    ) -> None:
        self._redis, self._errors = redis_store(url, timeout_s)
        self._report = errors or StoreErrors("rate-limit")
        self._limits = limits
        self._prefix = prefix
        self._ttl_ms = max(1, int(lease_ttl_s * 1000))
        self._renew_s = lease_ttl_s / 3
        self._bucket = self._redis.register_script(_BUCKET_LUA)
        self._acquire = self._redis.register_script(_ACQUIRE_LUA)
        self._renew = self._redis.register_script(_RENEW_LUA)
        self._leases: dict[str, dict[str, None]] = {}  # set name -> this process's lease ids
        self._renewer: asyncio.Task[None] | None = None

    async def close(self) -> None:
        renewer, self._renewer = self._renewer, None
        if renewer is not None:
            renewer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await renewer
        await self._redis.aclose()

    async def _call(self, what: str, call: Any, *args: Any, **kwargs: Any) -> Any:
        """The Redis call's result, or None when Redis failed (reported: the request goes on)."""
        try:
            return await call(*args, **kwargs)
        except self._errors as exc:
            self._report(what, exc)
            return None

    async def _take(self, key: str, take: int) -> tuple[float, Budget] | None:
        """Seconds to wait (0: granted) and the budget left, taking ``take`` tokens from the
        key's bucket; None without a rate limit or when Redis failed."""
        limits = self._limits
        if limits.rate_per_s is None:
            return None
        answer = await self._call(
            "bucket",
            self._bucket,
            keys=[f"{self._prefix}:bucket:{key}"],
            args=[limits.rate_per_s, limits.burst, take],
        )
        if answer is None:
            return None
        wait_ms, milli_tokens = answer
        return int(wait_ms) / 1000, limits.budget(int(milli_tokens) / 1000)

    def _keep(self, name: str, lease: str) -> None:
        self._leases.setdefault(name, {})[lease] = None
        if self._renewer is None:
            self._renewer = asyncio.get_running_loop().create_task(self._renew_leases())

    def _drop(self, name: str, lease: str) -> None:
        held = self._leases.get(name)
        if held is not None:
            held.pop(lease, None)
            if not held:
                del self._leases[name]

    async def _renew_leases(self) -> None:
        """Push the expiry of every lease this process holds, every ``lease_ttl_s / 3``."""
        while True:
            await asyncio.sleep(self._renew_s)
            for name, held in list(self._leases.items()):
                if not held:
                    continue
                try:
                    await self._call("renew", self._renew, keys=[name], args=[self._ttl_ms, *held])
                except Exception:  # a bug must not end the renewals of every later lease
                    log.exception("renewing the concurrency leases of %s failed", name)

    @asynccontextmanager
    async def hold(self, key: str) -> AsyncIterator[Budget | None]:
        limits = self._limits
        name = f"{self._prefix}:inflight:{key}"
        lease: str | None = None
        if limits.max_concurrent is not None:
            lease = secrets.token_hex(12)
            admitted = await self._call(
                "acquire",
                self._acquire,
                keys=[name],
                args=[limits.max_concurrent, self._ttl_ms, lease],
            )
            if admitted is not None and not admitted:
                looked = await self._take(key, 0)
                raise _refuse(
                    1.0,
                    f"too many concurrent requests for this API key "
                    f"(limit {limits.max_concurrent})",
                    None if looked is None else looked[1],
                )
            if admitted is None:
                lease = None
            else:
                self._keep(name, lease)
        try:
            taken = await self._take(key, 1)
            if taken is not None and taken[0]:
                raise _refuse(
                    taken[0],
                    f"rate limit of {limits.rate_per_s:g} requests/s exceeded for this API key",
                    taken[1],
                )
            yield None if taken is None else taken[1]
        finally:
            if lease is not None:
                self._drop(name, lease)
                await self._call("release", self._redis.zrem, name, lease)
