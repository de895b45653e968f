"""Stored responses: what ``previous_response_id`` continues and ``GET``/``DELETE
/v1/responses/{id}`` read.

``responses.store`` (``app.config.ResponsesConfig``) picks the backend:

- ``none`` (the default): stateless. ``store: true`` (the API's default) is a hint and nothing is
  kept; ``previous_response_id`` is a 400 and ``GET``/``DELETE`` a 404.
- ``memory``: this process keeps the last responses, bounded by ``max_items`` and ``max_bytes``
  (least recently used first out) and by ``ttl_s``. Gateway replicas (and ``--processes N``) do
  not share it: use it with one process.
- ``redis``: kept in the Redis of ``limits.redis_url`` for ``ttl_s``, so any replica continues a
  conversation any other one answered.

A record is the Response object and the chat messages a later request continues from (the input,
the stored conversation it continued, and the answer as an assistant turn) with those messages'
JSON size (a later request continuing from it is bounded by it before it is built), one JSON
document, keyed by the caller's API key name and the response id: one key can neither read nor
delete another's responses. A response is saved when its last event is produced, before the
client has it (memory: at once; Redis: the write is under way), and a lookup that misses waits
briefly for a write still in flight (``fetch``). Only completed and incomplete responses are kept
(a failed or abandoned one has nothing to continue from). A Redis failure is logged and counted
as the limit stores' are; the request in flight is not failed for it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Protocol

import orjson

from app.config import ResponsesConfig
from app.limits import StoreErrors, redis_store

log = logging.getLogger(__name__)
Clock = Callable[[], float]
OPEN = "-"  # the key name of a gateway without API keys
# A miss is read again after these pauses: a write another replica started a moment ago.
RETRY_S = (0.02, 0.05, 0.1, 0.2)


class ResponseStore(Protocol):
    def save(self, key: str | None, response_id: str, record: dict[str, Any]) -> None:
        """Keep ``record`` (at once, or with the write under way)."""

    async def get(self, key: str | None, response_id: str) -> dict[str, Any] | None: ...

    async def delete(self, key: str | None, response_id: str) -> bool: ...

    async def close(self) -> None: ...


async def fetch(store: ResponseStore, key: str | None, response_id: str) -> dict[str, Any] | None:
    """``store.get``, read again a few times over ~0.4 s when it misses."""
    record = await store.get(key, response_id)
    for pause in RETRY_S:
        if record is not None:
            break
        await asyncio.sleep(pause)
        record = await store.get(key, response_id)
    return record


class MemoryStore:
    def __init__(self, config: ResponsesConfig, clock: Clock = time.monotonic) -> None:
        self._ttl_s = config.ttl_s
        self._max_items = config.max_items
        self._max_bytes = config.max_bytes
        self._clock = clock
        self._items: OrderedDict[tuple[str, str], tuple[float, bytes]] = OrderedDict()
        self._bytes = 0

    def save(self, key: str | None, response_id: str, record: dict[str, Any]) -> None:
        data = orjson.dumps(record)
        if len(data) > self._max_bytes:
            log.info("response %s not stored: %d bytes", response_id, len(data))
            return
        name = (key or OPEN, response_id)
        self._drop(name)
        self._items[name] = (self._clock() + self._ttl_s, data)
        self._bytes += len(data)
        while len(self._items) > self._max_items or self._bytes > self._max_bytes:
            oldest = next(iter(self._items))
            self._drop(oldest)

    def _drop(self, name: tuple[str, str]) -> bool:
        held = self._items.pop(name, None)
        if held is None:
            return False
        self._bytes -= len(held[1])
        return True

    async def get(self, key: str | None, response_id: str) -> dict[str, Any] | None:
        name = (key or OPEN, response_id)
        held = self._items.get(name)
        if held is None:
            return None
        if held[0] <= self._clock():
            self._drop(name)
            return None
        self._items.move_to_end(name)
        record: dict[str, Any] = orjson.loads(held[1])
        return record

    async def delete(self, key: str | None, response_id: str) -> bool:
        return self._drop((key or OPEN, response_id))

    async def close(self) -> None:
        self._items.clear()
        self._bytes = 0


class RedisStore:
    """Records in Redis under ``{prefix}:response:{key}:{id}`` with a TTL; every call bounded by
    ``timeout_s``. A failed read is a miss, a failed write a response not kept (both reported)."""

    def __init__(
        self,
        url: str,
        config: ResponsesConfig,
        *,
        prefix: str = "dflash-gateway",
        timeout_s: float = 0.5,
        errors: StoreErrors | None = None,
    ) -> None:
        self._redis, self._errors = redis_store(url, timeout_s)
        self._report = errors or StoreErrors("response")
        self._prefix = prefix
        self._ttl_ms = int(config.ttl_s * 1000)
        self._max_bytes = config.max_bytes
        self._writes: set[asyncio.Task[None]] = set()

    def _name(self, key: str | None, response_id: str) -> str:
        return f"{self._prefix}:response:{key or OPEN}:{response_id}"

    def save(self, key: str | None, response_id: str, record: dict[str, Any]) -> None:
        data = orjson.dumps(record)
        if len(data) > self._max_bytes:
            log.info("response %s not stored: %d bytes", response_id, len(data))
            return
        task = asyncio.get_running_loop().create_task(
            self._write(self._name(key, response_id), data)
        )
        self._writes.add(task)
        task.add_done_callback(self._writes.discard)

    async def _write(self, name: str, data: bytes) -> None:
        try:
            await self._redis.set(name, data, px=self._ttl_ms)
        except self._errors as exc:
            self._report("save", exc)

    async def get(self, key: str | None, response_id: str) -> dict[str, Any] | None:
        try:
            data = await self._redis.get(self._name(key, response_id))
        except self._errors as exc:
            self._report("get", exc)
            return None
        if data is None:
            return None
        try:
            record = orjson.loads(data)
        except orjson.JSONDecodeError:
            return None
        return record if isinstance(record, dict) else None

    async def delete(self, key: str | None, response_id: str) -> bool:
        try:
            return bool(await self._redis.delete(self._name(key, response_id)))
        except self._errors as exc:
            self._report("delete", exc)
            return False

    async def close(self) -> None:
        if self._writes:
            await asyncio.wait(self._writes, timeout=2.0)
        await self._redis.aclose()


def make_store(config: ResponsesConfig, redis_url: str | None) -> ResponseStore | None:
    """The configured store (None: stateless; ``Settings`` checked that Redis has a URL)."""
    if config.store == "memory":
        return MemoryStore(config)
    if config.store == "redis" and redis_url:
        return RedisStore(redis_url, config)
    return None
