"""The in-process response store (``app.response_store.MemoryStore``): bounded by count, bytes
and time, least recently used out first, one key's responses invisible to another."""

from __future__ import annotations

import pytest

from app.response_store.backends import MemoryStore, make_store
from app.response_store.config import ResponsesConfig


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def record(size: int = 10) -> dict[str, object]:
    return {"response": {"id": "r"}, "messages": [{"role": "user", "content": "x" * size}]}


async def test_per_key_ttl_and_delete() -> None:
    clock = Clock()
    store = MemoryStore(ResponsesConfig(store="memory", ttl_s=60), clock)
    store.save("team-a", "resp_1", record())
    assert await store.get("team-a", "resp_1") == record()
    assert await store.get("team-b", "resp_1") is None  # another key
    assert await store.get(None, "resp_1") is None
    assert not await store.delete("team-b", "resp_1")
    clock.now = 61
    assert await store.get("team-a", "resp_1") is None  # expired
    store.save("team-a", "resp_2", record())
    assert await store.delete("team-a", "resp_2")
    assert await store.get("team-a", "resp_2") is None


async def test_bounded_by_count_and_bytes_least_recently_used_first() -> None:
    config = ResponsesConfig(store="memory", max_items=2, max_bytes=1024 * 1024)
    store = MemoryStore(config, Clock())
    for name in ("a", "b"):
        store.save("k", name, record())
    assert await store.get("k", "a") is not None  # now the most recently used
    store.save("k", "c", record())
    assert await store.get("k", "b") is None
    assert await store.get("k", "a") is not None and await store.get("k", "c") is not None
    big = MemoryStore(ResponsesConfig(store="memory", max_bytes=1024 * 1024), Clock())
    for name in ("x", "y", "z"):
        big.save("k", name, record(400 * 1024))
    assert await big.get("k", "x") is None  # pushed out by bytes
    big.save("k", "huge", record(2 * 1024 * 1024))  # larger than the whole store: not kept
    assert await big.get("k", "huge") is None and await big.get("k", "z") is not None


def test_no_store_by_default_and_redis_needs_a_url() -> None:
    assert make_store(ResponsesConfig(), None) is None
    from app.config import Settings

    with pytest.raises(ValueError, match="redis_url"):
        Settings(responses={"store": "redis"})
    with pytest.raises(ValueError, match="one process"):
        Settings(responses={"store": "memory"}, processes=2)


async def test_each_key_has_its_own_share_and_a_full_store_takes_from_the_largest() -> None:
    config = ResponsesConfig(
        store="memory", max_bytes=1024 * 1024, key_max_bytes=300 * 1024, key_max_items=3
    )
    store = MemoryStore(config, Clock())
    store.save("b", "b1", record(100 * 1024))
    for i in range(10):  # far past a's share: only a's own oldest go
        store.save("a", f"a{i}", record(100 * 1024))
    assert await store.get("b", "b1") is not None
    assert await store.get("a", "a6") is None and await store.get("a", "a9") is not None
    for i in range(3):  # items: a's share is three responses
        store.save("a", f"small{i}", record())
    assert await store.get("a", "a9") is None and await store.get("a", "small0") is not None
    # The whole store full: the key holding the most gives way, the writer among equals.
    for name in ("c", "d", "e", "f"):
        for i in range(2):
            store.save(name, f"{name}{i}", record(120 * 1024))
    # f's second write passed 1 MiB: c, d, e and f hold as much, f (the writer) gave way.
    assert await store.get("f", "f0") is None and await store.get("f", "f1") is not None
    assert await store.get("c", "c0") is not None
    assert await store.get("b", "b1") is not None
    store.save("b", "b2", record(100 * 1024))  # past 1 MiB again: the largest holder gives way
    assert await store.get("b", "b1") is not None and await store.get("b", "b2") is not None
    held = [await store.get(n, f"{n}{i}") is not None for n in ("c", "d", "e") for i in (0, 1)]
    assert held.count(False) == 1
