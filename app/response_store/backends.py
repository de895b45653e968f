"""Stored responses: what ``previous_response_id`` continues and ``GET``/``DELETE
/v1/responses/{id}`` read.

``responses.store`` (``app.response_store.config.ResponsesConfig``) picks the backend:

- ``none`` (the default): stateless. ``store: true`` (the API's default) is a hint and nothing is
  kept; ``previous_response_id`` is a 400 and ``GET``/``DELETE`` a 404.
- ``memory``: this process keeps the last responses, bounded by ``max_items`` and ``max_bytes``
  (least recently used first out) and by ``ttl_s``. Gateway replicas (and ``--processes N``) do
  not share it: use it with one process.
- ``redis``: kept in the Redis of ``limits.redis_url`` for ``ttl_s``, so any replica continues a
  conversation any other one answered.

Either way each API key has a share of its own, ``key_max_bytes`` of stored JSON and
``key_max_items`` responses: the bytes a key stores are charged to it, and its write past its
share evicts its own oldest responses, never another key's.

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
from dataclasses import dataclass, field
from typing import Any, Protocol

import orjson

from app.limits.per_key import StoreErrors, redis_store
from app.response_store.config import ResponsesConfig

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


@dataclass(slots=True)
class _Share:
    """One key's responses, least recently used first, and their bytes."""

    items: OrderedDict[str, tuple[float, bytes]] = field(default_factory=OrderedDict)
    bytes: int = 0


class MemoryStore:
    """Each key's responses in a share of its own (``key_max_items``, ``key_max_bytes``): a
    write past it evicts the writer's least recently used. The whole store is bounded too
    (``max_items``, ``max_bytes``); when it is full the key holding the most (bytes, or
    responses) gives way, the writer first among equals."""

    def __init__(self, config: ResponsesConfig, clock: Clock = time.monotonic) -> None:
        self._ttl_s = config.ttl_s
        self._max_items = config.max_items
        self._max_bytes = config.max_bytes
        self._key_items = config.key_max_items
        self._key_bytes = config.key_max_bytes
        self._largest_record = min(config.max_bytes, config.key_max_bytes)
        self._clock = clock
        self._shares: dict[str, _Share] = {}
        self._count = 0
        self._bytes = 0

    def save(self, key: str | None, response_id: str, record: dict[str, Any]) -> None:
        data = orjson.dumps(record)
        if len(data) > self._largest_record:
            log.info("response %s not stored: %d bytes", response_id, len(data))
            return
        name = key or OPEN
        self._drop(name, response_id)
        share = self._shares.setdefault(name, _Share())
        now = self._clock()
        while share.items and next(iter(share.items.values()))[0] <= now:  # expired
            self._drop(name, next(iter(share.items)))
        share.items[response_id] = (now + self._ttl_s, data)
        share.bytes += len(data)
        self._count += 1
        self._bytes += len(data)
        while len(share.items) > self._key_items or share.bytes > self._key_bytes:
            self._drop(name, next(iter(share.items)))
        while self._count > self._max_items or self._bytes > self._max_bytes:
            self._evict(name, by_bytes=self._bytes > self._max_bytes)

    def _evict(self, writer: str, *, by_bytes: bool) -> None:
        """The least recently used response of the key holding the most."""

        def held(name: str) -> tuple[int, bool]:
            share = self._shares[name]
            return (share.bytes if by_bytes else len(share.items), name == writer)

        largest = max(self._shares, key=held)
        self._drop(largest, next(iter(self._shares[largest].items)))

    def _drop(self, name: str, response_id: str) -> bool:
        share = self._shares.get(name)
        held = None if share is None else share.items.pop(response_id, None)
        if share is None or held is None:
            return False
        share.bytes -= len(held[1])
        self._count -= 1
        self._bytes -= len(held[1])
        if not share.items:
            del self._shares[name]
        return True

    async def get(self, key: str | None, response_id: str) -> dict[str, Any] | None:
        name = key or OPEN
        share = self._shares.get(name)
        held = None if share is None else share.items.get(response_id)
        if share is None or held is None:
            return None
        if held[0] <= self._clock():
            self._drop(name, response_id)
            return None
        share.items.move_to_end(response_id)
        record: dict[str, Any] = orjson.loads(held[1])
        return record

    async def delete(self, key: str | None, response_id: str) -> bool:
        return self._drop(key or OPEN, response_id)

    async def close(self) -> None:
        self._shares.clear()
        self._count = self._bytes = 0


# One key's share in Redis: its records (``{prefix}:response:{key}:{id}``), a sorted set of their
# ids scored by when they expire (``...:responses:{key}``, on the server's clock) and a hash of
# their sizes, with their total under the field "" (``...:response-sizes:{key}``). A save drops
# the expired ids, replaces a record saved again, then evicts the key's oldest until its share
# holds; it returns how many it evicted.
_SAVE_LUA = """
local record, index, sizes = KEYS[1], KEYS[2], KEYS[3]
local data, ttl, id = ARGV[1], tonumber(ARGV[2]), ARGV[3]
local max_bytes, max_items, prefix = tonumber(ARGV[4]), tonumber(ARGV[5]), ARGV[6]
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local total = tonumber(redis.call('HGET', sizes, '') or '0')
local function forget(member)
  total = total - tonumber(redis.call('HGET', sizes, member) or '0')
  redis.call('HDEL', sizes, member)
  redis.call('ZREM', index, member)
end
for _, member in ipairs(redis.call('ZRANGEBYSCORE', index, '-inf', now)) do forget(member) end
forget(id)
redis.call('SET', record, data, 'PX', ttl)
redis.call('ZADD', index, now + ttl, id)
redis.call('HSET', sizes, id, #data)
total = total + #data
local evicted = 0
while total > max_bytes or redis.call('ZCARD', index) > max_items do
  local oldest = redis.call('ZRANGE', index, 0, 0)[1]
  if oldest == nil or oldest == id then break end
  forget(oldest)
  redis.call('DEL', prefix .. oldest)
  evicted = evicted + 1
end
redis.call('HSET', sizes, '', total)
redis.call('PEXPIRE', index, ttl)
redis.call('PEXPIRE', sizes, ttl)
return evicted
"""
_DELETE_LUA = """
local record, index, sizes, id = KEYS[1], KEYS[2], KEYS[3], ARGV[1]
local deleted = redis.call('DEL', record)
local size = tonumber(redis.call('HGET', sizes, id) or '0')
redis.call('HDEL', sizes, id)
redis.call('ZREM', index, id)
if size > 0 and redis.call('EXISTS', sizes) == 1 then redis.call('HINCRBY', sizes, '', -size) end
return deleted
"""


class RedisStore:
    """Records in Redis under ``{prefix}:response:{key}:{id}`` with a TTL, each key in a share of
    its own (``key_max_items``, ``key_max_bytes``: its oldest saved out first, updated
    atomically in a Lua script); every call bounded by ``timeout_s``. A failed read is a miss, a
    failed write a response not kept (both reported)."""

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
        self._ttl_ms = max(1, int(config.ttl_s * 1000))
        self._key_items = config.key_max_items
        self._key_bytes = config.key_max_bytes
        self._largest_record = min(config.max_bytes, config.key_max_bytes)
        self._save = self._redis.register_script(_SAVE_LUA)
        self._delete = self._redis.register_script(_DELETE_LUA)
        self._writes: set[asyncio.Task[None]] = set()

    def _names(self, key: str | None, response_id: str) -> list[str]:
        """The record's name, its key's index and sizes."""
        key = key or OPEN
        return [
            f"{self._prefix}:response:{key}:{response_id}",
            f"{self._prefix}:responses:{key}",
            f"{self._prefix}:response-sizes:{key}",
        ]

    def save(self, key: str | None, response_id: str, record: dict[str, Any]) -> None:
        data = orjson.dumps(record)
        if len(data) > self._largest_record:
            log.info("response %s not stored: %d bytes", response_id, len(data))
            return
        names = self._names(key, response_id)
        prefix = names[0][: -len(response_id)]
        args = [data, self._ttl_ms, response_id, self._key_bytes, self._key_items, prefix]
        task = asyncio.get_running_loop().create_task(self._write(names, args))
        self._writes.add(task)
        task.add_done_callback(self._writes.discard)

    async def _write(self, names: list[str], args: list[Any]) -> None:
        try:
            await self._save(keys=names, args=args)
        except self._errors as exc:
            self._report("save", exc)

    async def get(self, key: str | None, response_id: str) -> dict[str, Any] | None:
        try:
            data = await self._redis.get(self._names(key, response_id)[0])
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
            return bool(await self._delete(keys=self._names(key, response_id), args=[response_id]))
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
