"""Per-key request-rate and concurrent-request limits.

A token bucket per key name (``rate_per_s`` sustained, ``burst`` at once) and a cap on requests in
flight per key. Over either limit the request is refused with 429 + ``Retry-After`` (the only 429
the gateway sends; see CONTRACTS.md). The in-process backend limits each gateway process on its
own; the Redis backend shares the limits across gateway replicas and processes, with the bucket
updated atomically in a Lua script on the Redis server's clock. If Redis cannot be reached the
request is let through (logged): a limiter outage must not become a gateway outage.

``make_limiter`` picks the backend from ``LimitsConfig``; None when no per-key limit is set.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, Protocol

from app.config import LimitsConfig
from app.errors import RateLimited

log = logging.getLogger(__name__)
Clock = Callable[[], float]


@dataclass(frozen=True, slots=True)
class KeyLimits:
    rate_per_s: float | None = None  # None: no rate limit
    burst: int = 10
    max_concurrent: int | None = None  # None: no concurrency limit


class Limiter(Protocol):
    def hold(self, key: str) -> Any:
        """``async with limiter.hold(key):`` for the whole request; raises RateLimited."""
        ...

    async def close(self) -> None: ...


def make_limiter(config: LimitsConfig, clock: Clock = time.monotonic) -> Limiter | None:
    limits = KeyLimits(
        rate_per_s=config.key_rate_per_s,
        burst=config.key_burst,
        max_concurrent=config.key_max_concurrent,
    )
    if limits.rate_per_s is None and limits.max_concurrent is None:
        return None
    if config.redis_url:
        return RedisLimiter(config.redis_url, limits)
    return LocalLimiter(limits, clock)


class TokenBucket:
    def __init__(self, rate_per_s: float, burst: int, clock: Clock) -> None:
        self._rate = rate_per_s
        self._burst = float(burst)
        self._clock = clock
        self._tokens = float(burst)
        self._stamp = clock()

    def take(self) -> float:
        """Take one token: 0.0 when granted, else the seconds until one is available."""
        now = self._clock()
        self._tokens = min(self._burst, self._tokens + (now - self._stamp) * self._rate)
        self._stamp = now
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            return 0.0
        return (1.0 - self._tokens) / self._rate


def _refuse(wait_s: float, why: str) -> RateLimited:
    return RateLimited(why, retry_after=max(1, math.ceil(wait_s)))


class LocalLimiter:
    """Limits within this process."""

    def __init__(self, limits: KeyLimits, clock: Clock = time.monotonic) -> None:
        self._limits = limits
        self._clock = clock
        self._buckets: dict[str, TokenBucket] = {}
        self._in_flight: dict[str, int] = {}

    async def close(self) -> None:
        pass

    @asynccontextmanager
    async def hold(self, key: str) -> AsyncIterator[None]:
        limits = self._limits
        if limits.max_concurrent is not None and (
            self._in_flight.get(key, 0) >= limits.max_concurrent
        ):
            raise _refuse(
                1.0,
                f"too many concurrent requests for this API key (limit {limits.max_concurrent})",
            )
        if limits.rate_per_s is not None:
            bucket = self._buckets.get(key)
            if bucket is None:
                bucket = self._buckets[key] = TokenBucket(
                    limits.rate_per_s, limits.burst, self._clock
                )
            wait = bucket.take()
            if wait:
                raise _refuse(
                    wait,
                    f"rate limit of {limits.rate_per_s:g} requests/s exceeded for this API key",
                )
        self._in_flight[key] = self._in_flight.get(key, 0) + 1
        try:
            yield
        finally:
            self._in_flight[key] -= 1


# KEYS[1] bucket hash; ARGV rate, burst. Returns 0 when granted, else milliseconds to wait.
_BUCKET_LUA = """
local now = redis.call('TIME')
local t = tonumber(now[1]) + tonumber(now[2]) / 1e6
local rate, burst = tonumber(ARGV[1]), tonumber(ARGV[2])
local state = redis.call('HMGET', KEYS[1], 'tokens', 'stamp')
local tokens = tonumber(state[1]) or burst
local stamp = tonumber(state[2]) or t
tokens = math.min(burst, tokens + (t - stamp) * rate)
local wait = 0
if tokens >= 1 then tokens = tokens - 1 else wait = math.ceil((1 - tokens) / rate * 1000) end
redis.call('HSET', KEYS[1], 'tokens', tokens, 'stamp', t)
redis.call('PEXPIRE', KEYS[1], math.ceil(burst / rate * 1000) + 1000)
return wait
"""

# KEYS[1] counter; ARGV limit, ttl ms. Returns 1 when admitted.
_ACQUIRE_LUA = """
local n = tonumber(redis.call('GET', KEYS[1]) or '0')
if n >= tonumber(ARGV[1]) then return 0 end
redis.call('INCR', KEYS[1])
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
"""


class RedisLimiter:
    """Limits shared by every gateway replica through one Redis. A replica that dies holding
    concurrency slots leaks them only until the counter's TTL (``lease_ttl_s``) expires. Every
    Redis call is bounded by ``timeout_s``; on any Redis error the request is admitted."""

    def __init__(
        self,
        url: str,
        limits: KeyLimits,
        *,
        prefix: str = "dflash-gateway",
        lease_ttl_s: float = 3600.0,
        timeout_s: float = 0.5,
    ) -> None:
        import redis.asyncio as redis
        from redis.exceptions import RedisError

        self._redis: Any = redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s
        )
        self._errors = (RedisError, OSError)
        self._limits = limits
        self._prefix = prefix
        self._ttl_ms = int(lease_ttl_s * 1000)
        self._bucket = self._redis.register_script(_BUCKET_LUA)
        self._acquire = self._redis.register_script(_ACQUIRE_LUA)

    async def close(self) -> None:
        await self._redis.aclose()

    async def _call(self, what: str, call: Any, **kwargs: Any) -> Any:
        """The Redis call's result, or None when Redis failed (logged: the request goes on)."""
        try:
            return await call(**kwargs)
        except self._errors as exc:
            log.warning("rate-limit store unavailable (%s: %s); not limiting", what, exc)
            return None

    @asynccontextmanager
    async def hold(self, key: str) -> AsyncIterator[None]:
        limits = self._limits
        counter = f"{self._prefix}:inflight:{key}"
        counted = False
        if limits.max_concurrent is not None:
            admitted = await self._call(
                "acquire", self._acquire, keys=[counter], args=[limits.max_concurrent, self._ttl_ms]
            )
            if admitted is not None and not admitted:
                raise _refuse(
                    1.0,
                    f"too many concurrent requests for this API key "
                    f"(limit {limits.max_concurrent})",
                )
            counted = admitted is not None
        try:
            if limits.rate_per_s is not None:
                wait_ms = await self._call(
                    "bucket",
                    self._bucket,
                    keys=[f"{self._prefix}:bucket:{key}"],
                    args=[limits.rate_per_s, limits.burst],
                )
                if wait_ms:
                    raise _refuse(
                        int(wait_ms) / 1000,
                        f"rate limit of {limits.rate_per_s:g} requests/s exceeded for this API key",
                    )
            yield
        finally:
            if counted:
                await self._call("release", self._redis.decr, name=counter)
