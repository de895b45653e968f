"""Where each agent session's history lives, shared by every gateway replica through Redis.

Each replica's prefix index (``app.routing.cache_index``) knows only what that replica sent. A
session placed off its rendezvous home (its first worker was busier) is found again by the
replica that placed it, but a replica that never saw it would send its next turn to the
rendezvous home and recompute the whole history there. With ``limits.redis_url`` set (the Redis
the per-key limits already share), ``cache_aware`` records the worker it sends each keyed long
prompt to under the session's routing key, and a replica that does not know the session reads
it before routing, so every replica agrees on where the history is.

One ``GET`` per keyed long prompt (before the pick), one ``SET`` when the session's worker
changes (after it, not awaited). Keys are a hash of the routing key (never the key itself),
kept ``ttl_s`` after the session's last move. Every call is bounded by ``timeout_s``; a Redis
failure only loses the hint (the rendezvous prior is used), and is counted.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

_PREFIX = "dflash:home:"


class SessionHomes:
    def __init__(
        self,
        client: Any,
        errors: tuple[type[Exception], ...],
        *,
        ttl_s: int = 3600,
        on_error: Callable[[], None] | None = None,
    ) -> None:
        self._client = client
        self._errors = errors
        self._ttl_s = ttl_s
        self._on_error = on_error
        self._writes: set[asyncio.Task[None]] = set()
        self._warned = -math.inf

    @staticmethod
    def _key(routing_key: str) -> str:
        return _PREFIX + hashlib.blake2b(routing_key.encode(), digest_size=16).hexdigest()

    async def lookup(self, routing_key: str) -> str | None:
        """The worker (its name) this session was last sent to by any replica, if known."""
        try:
            value = await self._client.get(self._key(routing_key))
        except self._errors:
            self._failed()
            return None
        if value is None:
            return None
        return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)

    def remember(self, routing_key: str, worker: str) -> None:
        """Record (not awaited) that this session now lives on ``worker``."""
        task = asyncio.get_running_loop().create_task(self._write(routing_key, worker))
        self._writes.add(task)
        task.add_done_callback(self._writes.discard)

    async def _write(self, routing_key: str, worker: str) -> None:
        try:
            await self._client.set(self._key(routing_key), worker, ex=self._ttl_s)
        except self._errors:
            self._failed()

    def _failed(self) -> None:
        now = time.monotonic()
        if now - self._warned >= 10.0:  # at most every 10 s, as the limits' store
            self._warned = now
            log.warning("session homes store unavailable: routing on this replica's own index")
        if self._on_error is not None:
            self._on_error()

    async def aclose(self) -> None:
        if self._writes:
            await asyncio.gather(*self._writes, return_exceptions=True)
        await self._client.aclose()
