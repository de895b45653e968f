"""The admission queue's order: priority classes first, then weighted fair shares across API keys;
waiters that leave are gone at once and a slot granted to them goes to the next."""

from __future__ import annotations

import asyncio
import collections
import gc

import pytest

from app.errors import ServiceUnavailable
from app.tenants.config import TenantPolicy, TenantsConfig
from app.tenants.tenant import Tenant, Tenants
from app.workers.admission import Admission
from app.workers.config import AdmissionConfig
from app.workers.fairqueue import FairQueue, Waiter
from app.workers.worker import Worker, WorkerState


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


TENANTS = Tenants(
    TenantsConfig(
        keys={
            "search": TenantPolicy(weight=3, priority="high", max_priority="high"),
            "evals": TenantPolicy(weight=1, priority="low", max_priority="normal"),
            "a": TenantPolicy(),
            "b": TenantPolicy(),
        }
    )
)


def tenant(key: str, priority: bytes | None = None) -> Tenant:
    return TENANTS.resolve(key, priority)


class Stack:
    """One full worker and an admission queue in front of it; ``client`` waits its turn and
    takes the slot as the proxy does (in flight before its next await)."""

    def __init__(self, queue_size: int = 500, timeout_s: float = 30.0) -> None:
        self.clock = FakeClock()
        self.admission = Admission(
            AdmissionConfig(per_worker_cap=1, queue_size=queue_size, queue_timeout_s=timeout_s),
            clock=self.clock,
        )
        self.worker = Worker(url="http://10.0.0.1:30000", state=WorkerState.HEALTHY)
        self.worker.in_flight = 1
        self.served: list[str] = []
        self.tasks: list[asyncio.Task[None]] = []

    async def client(self, label: str, who: Tenant | None) -> None:
        ready, _ = await self.admission.admit(lambda: [self.worker], who)
        assert ready == [self.worker]
        self.served.append(label)
        self.worker.in_flight += 1

    async def queue(self, label: str, who: Tenant | None) -> None:
        self.tasks.append(asyncio.create_task(self.client(label, who)))
        await asyncio.sleep(0)  # it reaches the queue

    async def free_slots(self, count: int) -> None:
        """``count`` requests finish one after the other, each freeing its slot."""
        for _ in range(count):
            self.worker.in_flight -= 1
            self.admission.release()
            for _ in range(3):
                await asyncio.sleep(0)

    async def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


async def test_higher_priority_classes_are_served_first() -> None:
    stack = Stack()
    await stack.queue("low", tenant("evals"))
    await stack.queue("normal", tenant("a"))
    await stack.queue("high", tenant("search"))
    await stack.queue("high, lowered by X-Priority", tenant("search", b"low"))
    await stack.free_slots(4)
    assert stack.served == ["high", "normal", "low", "high, lowered by X-Priority"]
    await stack.close()


async def test_weights_share_freed_slots_while_both_keys_wait() -> None:
    heavy = Tenants(TenantsConfig(keys={"x": TenantPolicy(weight=3), "y": TenantPolicy()}))
    stack = Stack()
    for _ in range(40):
        await stack.queue("x", heavy.resolve("x"))
        await stack.queue("y", heavy.resolve("y"))
    await stack.free_slots(40)
    shares = collections.Counter(stack.served)
    assert shares == {"x": 30, "y": 10}
    await stack.close()


async def test_a_key_with_one_request_is_not_behind_another_keys_backlog() -> None:
    stack = Stack()
    for _ in range(100):
        await stack.queue("a", tenant("a"))
    await stack.queue("b", tenant("b"))
    await stack.free_slots(1)
    assert stack.served == ["b"]
    # While both wait, equal weights alternate.
    await stack.queue("b", tenant("b"))
    await stack.queue("b", tenant("b"))
    await stack.free_slots(4)
    assert stack.served[1:] == ["a", "b", "a", "b"]
    await stack.close()


async def test_room_does_not_let_a_newcomer_pass_the_queue() -> None:
    stack = Stack()
    await stack.queue("high", tenant("search"))
    stack.worker.in_flight = 0  # room appeared without a freed slot being announced
    await stack.queue("low newcomer", tenant("evals"))
    for _ in range(3):
        await asyncio.sleep(0)
    assert stack.served == ["high"]
    assert stack.admission.depth == 1
    await stack.close()


async def test_no_waiters_means_no_queueing() -> None:
    stack = Stack()
    stack.worker.in_flight = 0
    ready, waited = await stack.admission.admit(lambda: [stack.worker], tenant("evals"))
    assert (ready, waited) == ([stack.worker], 0.0)


async def test_a_waiter_that_leaves_is_out_at_once_and_its_slot_goes_on() -> None:
    stack = Stack()
    await stack.queue("first", tenant("a"))
    await stack.queue("second", tenant("a"))
    await stack.queue("third", tenant("a"))
    assert stack.admission.depth == 3
    stack.tasks[1].cancel()  # its client left while it waited
    await asyncio.sleep(0)
    assert stack.admission.depth == 2
    # Granted a slot, then gone before it could take it: the slot goes to the next waiter.
    stack.worker.in_flight -= 1
    stack.admission.release()
    stack.tasks[0].cancel()
    for _ in range(3):
        await asyncio.sleep(0)
    assert stack.served == ["third"]
    assert stack.admission.depth == 0
    await stack.close()


async def test_a_wake_up_the_waiter_cannot_use_passes_to_the_next() -> None:
    stack = Stack()
    other = Worker(url="http://10.0.0.2:30000", state=WorkerState.HEALTHY)
    other.in_flight = 1
    admitted: list[str] = []

    async def retried() -> None:  # already tried stack.worker: only ``other`` will do
        ready, _ = await stack.admission.admit(lambda: [other], tenant("search"))
        admitted.append(ready[0].name)

    waiting = asyncio.create_task(retried())
    await asyncio.sleep(0)
    await stack.queue("normal", tenant("a"))
    await stack.free_slots(1)  # a slot on stack.worker: the high one cannot use it
    assert stack.served == ["normal"]
    assert admitted == []
    assert stack.admission.depth == 1  # still waiting, first in line
    other.in_flight = 0
    stack.admission.release()
    await asyncio.wait_for(waiting, 5)
    assert admitted == ["10.0.0.2:30000"]


async def test_the_wait_times_out_on_the_admission_clock() -> None:
    stack = Stack(timeout_s=0.05)
    waiting = asyncio.create_task(stack.admission.admit(lambda: [stack.worker], tenant("a")))
    await asyncio.sleep(0)
    stack.clock.now += 60
    with pytest.raises(ServiceUnavailable, match="timed out") as info:
        await asyncio.wait_for(waiting, 5)
    assert info.value.retry_after == 2
    assert stack.admission.depth == 0


async def test_a_full_queue_refuses_a_class_that_would_be_served_last() -> None:
    stack = Stack(queue_size=2)
    await stack.queue("normal", tenant("a"))
    await stack.queue("normal", tenant("b"))
    with pytest.raises(ServiceUnavailable, match="queue is full"):
        await stack.admission.admit(lambda: [stack.worker], tenant("evals"))
    assert stack.admission.depth == 2
    await stack.close()


async def test_a_full_queue_makes_room_for_a_higher_class() -> None:
    stack = Stack(queue_size=2)
    await stack.queue("low 1", tenant("evals"))
    await stack.queue("low 2", tenant("evals"))
    await stack.queue("high", tenant("search"))
    for _ in range(3):
        await asyncio.sleep(0)
    assert stack.admission.depth == 2
    assert [task.done() for task in stack.tasks] == [False, True, False]  # the newest low left
    with pytest.raises(ServiceUnavailable, match="queue is full"):
        stack.tasks[1].result()
    await stack.free_slots(2)
    assert stack.served == ["high", "low 1"]
    await stack.close()


def test_fair_queue_lanes_skip_removed_waiters() -> None:
    queue = FairQueue(3)
    waiters = [Waiter("a", 1.0, 1) for _ in range(3)]
    for waiter in waiters:
        queue.push(waiter)
    queue.remove(waiters[0])
    queue.remove(waiters[1])
    assert queue.size == 1
    assert queue.pop() is waiters[2]
    assert queue.pop() is None
    assert queue.size == 0


async def test_a_slot_nobody_can_use_passes_each_waiter_once_then_stops() -> None:
    stack = Stack()
    elsewhere = Worker(url="http://10.0.0.2:30000", state=WorkerState.HEALTHY)
    elsewhere.in_flight = 1  # full: the only worker these waiters may still use
    waiting = [
        asyncio.create_task(stack.admission.admit(lambda: [elsewhere], tenant(key)))
        for key in ("a", "b", "search")
    ]
    await asyncio.sleep(0)
    await stack.free_slots(1)  # a slot on stack.worker, which none of them may use
    for _ in range(20):
        await asyncio.sleep(0)
    assert stack.admission.depth == 3  # each passed it on once; all still wait
    assert not any(task.done() for task in waiting)
    elsewhere.in_flight = 0
    stack.admission.release()
    done, _ = await asyncio.wait(waiting, timeout=5, return_when=asyncio.FIRST_COMPLETED)
    assert [task.result()[0] for task in done] == [[elsewhere]]
    for task in waiting:
        task.cancel()
    await asyncio.gather(*waiting, return_exceptions=True)
    assert stack.admission.depth == 0
    # Nothing is left granted or queued: a request with room goes straight through.
    stack.worker.in_flight = 0
    ready, waited = await stack.admission.admit(lambda: [stack.worker], tenant("a"))
    assert (ready, waited) == ([stack.worker], 0.0)


async def test_a_newcomer_gets_a_second_free_slot_while_a_granted_waiter_takes_the_first() -> None:
    admission = Admission(AdmissionConfig(per_worker_cap=2, queue_size=10, queue_timeout_s=30.0))
    worker = Worker(url="http://10.0.0.1:30000", state=WorkerState.HEALTHY)
    worker.in_flight = 2
    served: list[str] = []

    async def client(label: str, who: Tenant) -> None:
        ready, _ = await admission.admit(lambda: [worker], who)
        assert ready == [worker]
        served.append(label)
        worker.in_flight += 1  # in flight before its next await, as the proxy does

    waiting = asyncio.create_task(client("waiter", tenant("a")))
    await asyncio.sleep(0)
    assert admission.depth == 1
    # A request arrives in the same turn of the loop in which two requests end: one slot goes to
    # the waiter, the other is free for the newcomer.
    newcomer = asyncio.create_task(client("newcomer", tenant("b")))
    worker.in_flight -= 2
    admission.release()
    admission.release()
    for _ in range(5):
        await asyncio.sleep(0)
    assert sorted(served) == ["newcomer", "waiter"]  # nobody waits while a slot is free
    assert admission.depth == 0
    await asyncio.gather(waiting, newcomer)


def test_waiters_that_leave_a_lane_never_served_are_not_kept() -> None:
    queue = FairQueue(3)
    queue.push(Waiter("search", 1.0, 2))  # a high class that holds every freed slot
    queue.push(Waiter("evals", 1.0, 0))  # one low waiter stays queued throughout
    for _ in range(20000):  # low requests keep arriving and timing out, never served
        waiter = Waiter("evals", 1.0, 0)
        queue.push(waiter)
        queue.remove(waiter)
    del waiter
    gc.collect()
    alive = sum(1 for obj in gc.get_objects() if isinstance(obj, Waiter))
    assert queue.size == 2
    assert alive < 100  # the ones that left are not held by the queue


async def test_a_full_queue_held_by_one_key_still_lets_another_key_in() -> None:
    stack = Stack(queue_size=4)
    for _ in range(4):
        await stack.queue("a", tenant("a"))  # one key's burst fills the queue
    await stack.queue("b", tenant("b"))
    for _ in range(3):
        await asyncio.sleep(0)
    assert stack.admission.depth == 4
    # a's newest waiter gave b its place, and was refused as if it had come when the queue was full.
    refused = [task for task in stack.tasks if task.done()]
    assert len(refused) == 1 and stack.tasks.index(refused[0]) == 3
    with pytest.raises(ServiceUnavailable, match="queue is full"):
        refused[0].result()
    # The same key cannot push out its own waiters: a full queue still refuses it.
    with pytest.raises(ServiceUnavailable, match="queue is full"):
        await stack.admission.admit(lambda: [stack.worker], tenant("a"))
    await stack.free_slots(1)
    assert stack.served == ["b"]  # not behind a's backlog
    await stack.close()
