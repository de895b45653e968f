from __future__ import annotations

import random
from collections import Counter

import pytest

from app.routing.policies import (
    LeastInflight,
    PowerOfTwo,
    PrefixAffinity,
    RoundRobin,
    RoutingContext,
    make_policy,
)
from app.workers.worker import Worker, WorkerLoad, WorkerState

CTX = RoutingContext(model="m")


def _workers(n: int) -> list[Worker]:
    return [Worker(url=f"http://10.0.0.{i}:30000", state=WorkerState.HEALTHY) for i in range(n)]


def test_least_inflight_prefers_fewest_then_polled_load() -> None:
    a, b, c = _workers(3)
    a.in_flight, b.in_flight, c.in_flight = 3, 1, 1
    b.load = WorkerLoad(running=10, waiting=2)
    c.load = WorkerLoad(running=4)
    assert LeastInflight().pick(CTX, [a, b, c]) is c


def test_least_inflight_spreads_a_burst_evenly() -> None:
    workers = _workers(4)
    policy = LeastInflight()
    for _ in range(40):
        policy.pick(CTX, workers).in_flight += 1
    assert [w.in_flight for w in workers] == [10, 10, 10, 10]


def test_round_robin_cycles() -> None:
    workers = _workers(3)
    policy = RoundRobin()
    picks = [policy.pick(CTX, workers).name for _ in range(6)]
    assert picks == [w.name for w in workers] * 2


@pytest.mark.parametrize("name", ["random", "power_of_two"])
def test_random_policies_cover_all_workers_roughly_evenly(name: str) -> None:
    workers = _workers(4)
    policy = make_policy(name, rng=random.Random(7))
    counts = Counter(policy.pick(CTX, workers).name for _ in range(4000))
    assert set(counts) == {w.name for w in workers}
    assert max(counts.values()) < 1.25 * min(counts.values())


def test_power_of_two_never_picks_the_busier_of_its_pair() -> None:
    workers = _workers(2)
    workers[0].in_flight = 5
    policy = PowerOfTwo(random.Random(1))
    assert all(policy.pick(CTX, workers) is workers[1] for _ in range(50))


def test_make_policy_rejects_unknown_names() -> None:
    with pytest.raises(ValueError, match="unknown routing policy"):
        make_policy("fastest", rng=random.Random())


def _keyed(key: str) -> RoutingContext:
    return RoutingContext(model="m", routing_key=key)


def test_prefix_affinity_is_deterministic_across_independent_instances() -> None:
    # Two gateway replicas, built separately and seeing workers in different orders.
    first, second = PrefixAffinity(), PrefixAffinity()
    workers = _workers(8)
    shuffled = list(reversed(workers))
    for i in range(500):
        key = f"session-{i}"
        assert first.pick(_keyed(key), workers).name == second.pick(_keyed(key), shuffled).name


def test_prefix_affinity_spreads_keys_across_workers() -> None:
    workers = _workers(8)
    policy = PrefixAffinity()
    homes = Counter(policy.home(f"user-{i}", workers).name for i in range(8000))
    assert set(homes) == {w.name for w in workers}
    assert max(homes.values()) < 2.0 * min(homes.values())


def test_prefix_affinity_moves_only_the_removed_workers_keys() -> None:
    workers = _workers(8)
    policy = PrefixAffinity()
    before = {f"k{i}": policy.home(f"k{i}", workers).name for i in range(2000)}
    gone = workers[3].name
    after = {key: policy.home(key, workers[:3] + workers[4:]).name for key in before}
    moved = [key for key in before if before[key] != after[key]]
    assert moved
    assert all(before[key] == gone for key in moved)


def test_prefix_affinity_hot_key_spills_past_the_bound_and_returns_home() -> None:
    workers = _workers(4)
    policy = PrefixAffinity(load_factor=1.25)
    home = policy.home("hot", workers)
    placed = []
    for _ in range(40):
        chosen = policy.pick(_keyed("hot"), workers)
        chosen.in_flight += 1
        placed.append(chosen)
    total = sum(w.in_flight for w in workers)
    # No worker exceeds ceil(c * total / n): the hot key spilled instead of piling onto home.
    assert max(w.in_flight for w in workers) <= -(-1.25 * total // 4)
    assert home.in_flight == max(w.in_flight for w in workers)
    for worker in placed:
        worker.in_flight -= 1
    assert policy.pick(_keyed("hot"), workers) is home


def test_prefix_affinity_counts_load_other_replicas_put_on_a_worker() -> None:
    workers = _workers(3)
    policy = PrefixAffinity(load_factor=1.0)
    home = policy.home("k", workers)
    home.load = WorkerLoad(running=30)
    assert policy.pick(_keyed("k"), workers) is not home


def test_prefix_affinity_without_key_falls_back_to_least_inflight() -> None:
    workers = _workers(3)
    workers[0].in_flight = 2
    workers[1].in_flight = 2
    assert PrefixAffinity().pick(CTX, workers) is workers[2]


def test_prefix_affinity_agrees_with_a_fresh_ring_after_membership_churn() -> None:
    churned = PrefixAffinity()
    workers = _workers(12)
    for size in (12, 5, 9, 3, 12, 7):
        churned.pick(_keyed("warm"), workers[:size])
    current = workers[2:9]
    fresh = PrefixAffinity()
    for i in range(300):
        assert churned.home(f"s{i}", current) is fresh.home(f"s{i}", current)


def test_least_inflight_breaks_ties_by_name() -> None:
    workers = _workers(3)
    policy = LeastInflight()
    assert {policy.pick(CTX, list(reversed(workers))).name for _ in range(5)} == {workers[0].name}


def test_prefix_affinity_stays_home_at_light_load() -> None:
    # One request elsewhere in flight (or a stale polled count) must not push a key off its home.
    workers = _workers(3)
    policy = PrefixAffinity()
    home = policy.home("conversation", workers)
    home.load = WorkerLoad(running=2)
    assert policy.pick(_keyed("conversation"), workers) is home
