"""cache_aware with gateway replicas: where each session's history lives, shared through a real
redis-server, so a replica that never saw a session routes its turn to where another replica
placed it (not to the key's first worker, where the history would be prefilled again)."""

from __future__ import annotations

import asyncio

from app.limits.per_key import redis_store
from app.routing.cache_aware import CacheAware
from app.routing.shared_homes import SessionHomes
from app.workers.worker import Worker
from tests.routing.test_cache_aware import Session, _worker
from tests.security.conftest import redis_url

__all__ = ["redis_url"]


def _homes(url: str, errors: list[str]) -> SessionHomes:
    client, raised = redis_store(url, timeout_s=0.5)
    return SessionHomes(client, raised, on_error=lambda: errors.append("session_homes"))


async def _route(policy: CacheAware, session: Session, workers: list[Worker]) -> Worker:
    """One request as the door and the proxy run it: recall, pick, and over."""
    ctx = session.ctx()
    reading = policy.recall(ctx)
    if reading is not None:
        await reading
    worker = policy.pick(ctx, workers)
    policy.released(ctx)
    return worker


def _placed_off_its_first_worker(
    policy: CacheAware, workers: list[Worker]
) -> tuple[Session, Worker]:
    """A session whose first worker was too busy for its first turn: placed elsewhere."""
    session = Session(41)
    top = CacheAware().pick(session.ctx(), [_worker(i) for i in range(3)])  # idle fleet
    busy = next(w for w in workers if w.name == top.name)
    busy.in_flight = 40
    return session, busy


def test_a_replica_that_never_saw_a_session_sends_it_where_another_placed_it(
    redis_url: str,
) -> None:
    errors: list[str] = []

    async def run() -> tuple[Worker, Worker, Worker]:
        workers = [_worker(i) for i in range(3)]
        one = CacheAware(homes=_homes(redis_url, errors))
        other = CacheAware(homes=_homes(redis_url, errors))
        alone = CacheAware()  # a replica without the shared store
        session, busy = _placed_off_its_first_worker(one, workers)
        placed = await _route(one, session, workers)
        busy.in_flight = 0
        await asyncio.sleep(0.05)  # the store's write is not awaited by the pick
        session.turns = 1
        shared = await _route(other, session, workers)
        guessed = await _route(alone, session, workers)
        assert one.homes is not None and other.homes is not None
        await one.homes.aclose()
        await other.homes.aclose()
        return placed, shared, guessed

    placed, shared, guessed = asyncio.run(run())
    assert shared.name == placed.name
    assert guessed.name != placed.name  # the rendezvous prior alone: the key's first worker
    assert errors == []


def test_without_its_store_a_replica_routes_on_its_own_index() -> None:
    errors: list[str] = []

    async def run() -> Worker:
        workers = [_worker(i) for i in range(3)]
        policy = CacheAware(homes=_homes("redis://127.0.0.1:9/0", errors))
        session = Session(42, turns=2)
        worker = await _route(policy, session, workers)
        await asyncio.sleep(0.05)
        assert policy.homes is not None
        await policy.homes.aclose()
        return worker

    worker = asyncio.run(run())
    assert (
        worker.name
        == asyncio.run(
            _route(CacheAware(), Session(42, turns=2), [_worker(i) for i in range(3)])
        ).name
    )
    assert errors and set(errors) == {"session_homes"}
