"""``spare_capacity``: spare slots weighted by each worker's per-request output rate, with the
routing key kept on its worker while that worker is not clearly worse off than the best."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from app.routing.policies import RoutingContext, SpareCapacity, make_policy
from app.workers.worker import Worker, WorkerLoad, WorkerState

CTX = RoutingContext(model="m")


def _worker(i: int, **load: float) -> Worker:
    worker = Worker(url=f"http://10.0.0.{i}:30000", state=WorkerState.HEALTHY)
    for _ in range(3):  # polled a few times: the rate is averaged over busy polls
        worker.set_load(WorkerLoad(**load))  # type: ignore[arg-type]
    return worker


def _fill(policy: SpareCapacity, workers: list[Worker], n: int, key: bool = False) -> list[int]:
    for i in range(n):
        ctx = RoutingContext(model="m", routing_key=f"c:{i}") if key else CTX
        policy.pick(ctx, workers).in_flight += 1
    return [w.in_flight for w in workers]


def test_equal_workers_share_a_burst_evenly() -> None:
    workers = [_worker(i) for i in range(4)]
    assert _fill(SpareCapacity(), workers, 40) == [10, 10, 10, 10]


def test_the_faster_worker_gets_more_of_a_burst() -> None:
    # Both run 10 requests; one produces 4.5 tokens per request-step, the other (a slow node or
    # a collapsed drafter) half as many per second.
    fast = _worker(1, running=10, gen_throughput=1000.0, accept_length=4.5, max_running_requests=48)
    slow = _worker(2, running=10, gen_throughput=500.0, accept_length=4.5, max_running_requests=48)
    fast_n, slow_n = _fill(SpareCapacity(), [fast, slow], 40)
    assert fast_n > slow_n + 8


def test_spare_slots_count_the_capacity_each_worker_reports() -> None:
    small = _worker(1, max_running_requests=4)
    large = _worker(2, max_running_requests=16)
    assert _fill(SpareCapacity(), [small, large], 20) == [4, 16]


def test_requests_on_the_worker_from_other_replicas_leave_less_room() -> None:
    crowded = _worker(1, running=40, waiting=4, gen_throughput=4000.0)
    quiet = _worker(2, running=10, gen_throughput=1000.0)
    assert SpareCapacity().pick(CTX, [crowded, quiet]) is quiet


def test_requests_sent_since_the_last_poll_count_once() -> None:
    worker = _worker(1, running=10)
    worker.in_flight = 10
    worker.set_load(worker.load)  # the poll already counts our 10
    assert worker.busy == 10
    worker.in_flight = 13  # three more sent since
    assert worker.busy == 13


def test_a_full_kv_cache_counts_against_a_worker() -> None:
    full = _worker(1, running=10, gen_throughput=1000.0, token_usage=0.95)
    free = _worker(2, running=10, gen_throughput=1000.0, token_usage=0.1)
    assert SpareCapacity().pick(CTX, [full, free]) is free


def test_when_every_worker_is_full_the_faster_one_drains_first() -> None:
    slow = _worker(1, running=48, gen_throughput=1000.0, max_running_requests=48)
    fast = _worker(2, running=48, gen_throughput=3000.0, max_running_requests=48)
    assert SpareCapacity().pick(CTX, [slow, fast]) is fast


def test_a_key_stays_home_and_independent_replicas_agree() -> None:
    workers = [_worker(i) for i in range(4)]
    first, second = SpareCapacity(), SpareCapacity()
    for i in range(50):
        ctx = RoutingContext(model="m", routing_key=f"s:{i}")
        home = first.pick(ctx, workers)
        assert second.pick(ctx, list(reversed(workers))) is home
        assert first.pick(ctx, workers) is home
    spread = Counter(first.pick(RoutingContext("m", f"c:{i}"), workers).name for i in range(400))
    assert min(spread.values()) > 60


def test_a_hot_key_spills_by_capacity_and_comes_back() -> None:
    workers = [_worker(i, max_running_requests=48) for i in range(3)]
    policy = SpareCapacity(load_factor=1.25)
    ctx = RoutingContext(model="m", routing_key="s:hot")
    home = policy.pick(ctx, workers)
    picks = Counter()
    for _ in range(30):
        worker = policy.pick(ctx, workers)
        worker.in_flight += 1
        picks[worker.name] += 1
    assert picks[home.name] < 30 and len(picks) == 3  # spilled once home was clearly fuller
    for worker in workers:
        worker.in_flight = 0
    assert policy.pick(ctx, workers) is home


def test_removing_a_worker_moves_only_its_keys() -> None:
    workers = [_worker(i) for i in range(4)]
    policy = SpareCapacity()
    before = {i: policy.pick(RoutingContext("m", f"c:{i}"), workers) for i in range(200)}
    gone = workers[2]
    rest = [w for w in workers if w is not gone]
    for i, home in before.items():
        if home is not gone:
            assert policy.pick(RoutingContext("m", f"c:{i}"), rest) is home


def test_made_by_name_and_refuses_a_load_factor_below_one() -> None:
    assert make_policy("spare_capacity", rng=random.Random(0)).name == "spare_capacity"
    with pytest.raises(ValueError, match="load_factor"):
        SpareCapacity(load_factor=0.5)
