from __future__ import annotations

import asyncio

import pytest

from app.errors import ServiceUnavailable
from app.workers.admission import Admission
from app.workers.config import AdmissionConfig
from app.workers.health import parse_loads
from app.workers.worker import Worker, WorkerLoad, WorkerState


def _worker(n: int = 0) -> Worker:
    return Worker(url=f"http://10.0.0.{n}:30000", state=WorkerState.HEALTHY)


def _admission(**overrides: float) -> Admission:
    config = {"per_worker_cap": 2, "queue_size": 2, "queue_timeout_s": 5.0, **overrides}
    return Admission(AdmissionConfig(**config))  # type: ignore[arg-type]


async def test_room_counts_own_in_flight_and_the_workers_polled_load() -> None:
    admission = _admission()
    a, b = _worker(1), _worker(2)
    a.in_flight = 2
    b.load = WorkerLoad(running=1, waiting=1)  # other replicas filled it
    assert not admission.has_room(a)
    assert not admission.has_room(b)
    ready, waited = await admission.admit(lambda: [a, b, _worker(3)])
    assert [w.name for w in ready] == ["10.0.0.3:30000"]
    assert waited == 0.0


def test_each_worker_is_admitted_to_the_capacity_it_reports() -> None:
    admission = Admission(AdmissionConfig())
    small, large, unknown = _worker(1), _worker(2), _worker(3)
    small.set_load(WorkerLoad(max_running_requests=2))
    large.set_load(WorkerLoad(max_running_requests=6))
    for worker, cap in ((small, 2), (large, 6), (unknown, 48)):  # 48 until a worker reports
        assert admission.cap(worker) == cap
        worker.in_flight = cap - 1
        assert admission.has_room(worker)
        worker.in_flight = cap
        assert not admission.has_room(worker)


def test_a_configured_cap_overrides_what_workers_report() -> None:
    admission = Admission(AdmissionConfig(per_worker_cap=3))
    worker = _worker()
    worker.set_load(WorkerLoad(max_running_requests=6))
    assert admission.cap(worker) == 3
    worker.in_flight = 3
    assert not admission.has_room(worker)


def test_processes_share_each_workers_learned_cap() -> None:
    admission = Admission(AdmissionConfig(), processes=4)
    worker = _worker()
    worker.set_load(WorkerLoad(max_running_requests=6))
    worker.in_flight = 1
    assert admission.has_room(worker)
    worker.in_flight = 2  # ceil(6 / 4)
    assert not admission.has_room(worker)
    worker.in_flight = 0
    worker.set_load(WorkerLoad(running=5, waiting=1, max_running_requests=6))  # others filled it
    assert not admission.has_room(worker)


def test_each_process_admits_its_share_of_the_cap() -> None:
    admission = Admission(AdmissionConfig(per_worker_cap=48), processes=4)
    worker = _worker()
    worker.in_flight = 11
    assert admission.has_room(worker)
    worker.in_flight = 12
    assert not admission.has_room(worker)


async def test_full_queue_refuses_at_once_with_retry_after() -> None:
    admission = _admission(queue_size=1, queue_timeout_s=30)
    worker = _worker()
    worker.in_flight = 2
    waiting = asyncio.create_task(admission.admit(lambda: [worker]))
    await asyncio.sleep(0)
    assert admission.depth == 1
    with pytest.raises(ServiceUnavailable, match="queue is full") as info:
        await admission.admit(lambda: [worker])
    assert info.value.retry_after == 2
    worker.in_flight = 1
    admission.release()
    ready, waited = await asyncio.wait_for(waiting, 5)
    assert ready == [worker]
    assert waited >= 0


async def test_wait_times_out_with_503() -> None:
    admission = _admission(queue_timeout_s=0.2)
    worker = _worker()
    worker.in_flight = 2
    with pytest.raises(ServiceUnavailable, match="timed out"):
        await admission.admit(lambda: [worker])
    assert admission.depth == 0


async def test_waiters_are_served_first_in_first_out() -> None:
    admission = _admission(queue_size=5)
    worker = _worker()
    worker.in_flight = 2
    order: list[int] = []

    async def client(i: int) -> None:
        await admission.admit(lambda: [worker])
        order.append(i)
        worker.in_flight += 1  # takes the slot, as the proxy does before its next await

    tasks = []
    for i in range(3):
        tasks.append(asyncio.create_task(client(i)))
        await asyncio.sleep(0)
    for _ in range(3):
        worker.in_flight -= 1
        admission.release()
        await asyncio.sleep(0.01)
    await asyncio.wait_for(asyncio.gather(*tasks), 5)
    assert order == [0, 1, 2]


async def test_no_candidates_at_all_returns_empty_without_waiting() -> None:
    ready, waited = await _admission().admit(list)
    assert (ready, waited) == ([], 0.0)


def test_parse_loads_sums_ranks_and_reads_speculative_fields() -> None:
    load = parse_loads(
        {
            "loads": [
                {
                    "num_running_reqs": 30,
                    "num_waiting_reqs": 2,
                    "token_usage": 0.5,
                    "gen_throughput": 1500.0,
                    "max_running_requests": 48,
                    "speculative": {"accept_length": 5.2, "accept_rate": 0.6},
                },
                {
                    "num_running_reqs": 10,
                    "num_waiting_reqs": 0,
                    "token_usage": 0.7,
                    "gen_throughput": 500.0,
                    "max_running_requests": 48,
                    "speculative": {"accept_length": 5.4, "accept_rate": 0.62},
                },
            ]
        }
    )
    assert load is not None
    assert (load.running, load.waiting, load.max_running_requests) == (40, 2, 96)
    assert load.max_total_num_tokens is None  # not reported by every rank: unknown
    assert load.token_usage == 0.7
    assert load.gen_throughput == 2000.0
    assert load.accept_length == pytest.approx(5.3)
    assert load.accept_rate == pytest.approx(0.61)
    limits = parse_loads({"loads": [{"max_running_requests": 6, "max_total_num_tokens": 4096}]})
    assert limits is not None
    assert (limits.max_running_requests, limits.max_total_num_tokens) == (6, 4096)
    idle = parse_loads({"loads": [{"num_running_reqs": 0, "speculative": {"accept_length": 0}}]})
    assert idle is not None
    assert idle.accept_length is None  # nothing measured yet, not "acceptance 0"
    assert parse_loads({"loads": []}) is None
    assert parse_loads("nonsense") is None


@pytest.mark.parametrize(
    "hostile",
    [
        1.7e308,  # two ranks of it sum to an infinity (int() of it raised OverflowError)
        1e300,
        -1e18,
        float(2**31 + 1),
        2**64,
        "12",
        True,
    ],
)
def test_parse_loads_takes_only_plausible_figures(hostile: object) -> None:
    rank = {
        "num_running_reqs": hostile,
        "num_waiting_reqs": hostile,
        "token_usage": hostile,
        "gen_throughput": hostile,
        "max_running_requests": hostile,
        "max_total_num_tokens": hostile,
    }
    load = parse_loads({"loads": [rank, dict(rank)]})
    assert load == WorkerLoad()  # nothing taken: idle as far as its report goes, default cap


def test_parse_loads_checks_each_rank_and_the_sum() -> None:
    good = {"num_running_reqs": 3, "token_usage": 0.25, "gen_throughput": 10.0}
    bad = {"num_running_reqs": -5, "token_usage": 7.0, "gen_throughput": -1e30}
    load = parse_loads({"loads": [good, bad]})
    assert load is not None
    assert (load.running, load.token_usage, load.gen_throughput) == (3, 0.25, 10.0)
    big = {"num_running_reqs": 2**31, "max_running_requests": 2**31, "gen_throughput": 1.7e308}
    load = parse_loads({"loads": [big, big]})  # each rank plausible, the sums are not
    assert load is not None
    assert (load.running, load.max_running_requests, load.gen_throughput) == (0, None, 0.0)


def test_a_slot_freed_since_the_last_poll_is_free_at_once() -> None:
    admission = Admission(AdmissionConfig())
    worker = _worker()
    worker.in_flight = 2
    worker.set_load(WorkerLoad(running=2, max_running_requests=2))  # polled full: our two
    assert not admission.has_room(worker)
    worker.in_flight = 1  # one of ours ended after that poll
    assert admission.has_room(worker)
    worker.set_load(WorkerLoad(running=1, waiting=1, max_running_requests=2))  # another replica
    assert not admission.has_room(worker)


@pytest.mark.parametrize(
    "figures",
    [
        {"accept_length": 5e-324, "accept_rate": 1e308},  # the acceptance length a mean divides by
        {"accept_length": float("inf"), "accept_rate": float("nan")},
        {"accept_length": 10**400, "accept_rate": -0.5},
        {"accept_length": 500.0, "accept_rate": 2.0},
    ],
    ids=["tiny", "non-finite", "huge-int", "out-of-range"],
)
def test_implausible_speculative_figures_from_a_worker_are_not_taken(
    figures: dict[str, float],
) -> None:
    load = parse_loads(
        {"loads": [{"num_running_reqs": 10**400, "gen_throughput": 1e999, "speculative": figures}]}
    )
    assert load is not None
    assert load.accept_length is None and load.accept_rate is None
    assert load.running == 0 and load.gen_throughput == 0.0  # not numbers the gateway can use
