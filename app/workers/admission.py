"""Admission control: a per-worker cap, and a bounded FIFO queue in front of it.

A worker runs at most its ``max_running_requests`` at once (48 for DFLASH unless set otherwise);
more only queue inside SGLang where the gateway can neither see nor re-route them. Each worker's
cap is the limit it reports in ``/v1/loads`` (learned when it is admitted to the pool and on every
loads poll; 48 until then), or ``admission.per_worker_cap`` for every worker when that is set.
The gateway admits a request to a worker only while

- this process has fewer than ``cap / processes`` requests in flight there, and
- the worker's own polled ``running + waiting`` (all gateway replicas and processes together),
  corrected by this process's requests started and ended since that poll (``Worker.busy``), is
  below ``cap``: a slot this process freed is free again at once, not at the next poll.

When no candidate has room the request waits in a queue of at most ``queue_size`` entries for up
to ``queue_timeout_s``; a full queue answers 503 at once and a timed-out wait 503 too, both with
``Retry-After`` (docs/contracts.md). A request the full queue would serve before its last waiter (a
higher class, or another key than the one filling it) takes that waiter's place instead, and the
waiter gets the 503: one key's burst cannot shut the others out. Every slot freed is granted to
the waiter the queue serves next (``app.workers.fairqueue``: higher priority classes first, then
weighted fair queuing across API keys); a request that finds room while others wait queues too,
so it never passes them. A waiter that leaves (its client disconnected, its deadline passed) is
out of the queue at once, and a slot granted to it goes on to the next.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable, Sequence

from app.errors import ServiceUnavailable
from app.tenants.config import PRIORITIES
from app.tenants.tenant import Tenant
from app.workers.config import AdmissionConfig
from app.workers.fairqueue import FairQueue, Waiter
from app.workers.worker import Worker

Clock = Callable[[], float]
Candidates = Callable[[], Sequence[Worker]]
_DEFAULT_CLASS = PRIORITIES["normal"]
_FULL = "every worker is at capacity and the admission queue is full"


class Admission:
    def __init__(
        self,
        config: AdmissionConfig,
        *,
        processes: int = 1,
        clock: Clock = time.monotonic,
        deweight_collapsed: bool = False,
    ) -> None:
        self._config = config
        self._deweight = deweight_collapsed
        self._processes = processes
        self._clock = clock
        self._queue = FairQueue(len(PRIORITIES))
        self._granted = 0  # waiters granted a slot that have not taken it yet

    @property
    def depth(self) -> int:
        """Requests waiting for a slot now."""
        return self._queue.size

    def cap(self, worker: Worker) -> int:
        """The most requests ``worker`` may hold (all gateway processes together): the
        override, else what it reports."""
        return self._config.per_worker_cap or worker.capacity

    def room(self, worker: Worker) -> int:
        """Requests ``worker`` may take now: what this process's share of its cap leaves, and
        what its cap leaves of its polled ``running + waiting`` corrected by this process's
        requests since that poll (``Worker.busy``), whichever is less."""
        cap = self.cap(worker)
        in_flight, load = worker.in_flight, worker.load
        local = -(-cap // self._processes) - in_flight  # ceil(cap / processes) - in flight
        polled = load.running + load.waiting
        return min(local, cap - polled - in_flight + worker.in_flight_at_load)

    def has_room(self, worker: Worker) -> bool:
        return self.room(worker) > 0

    def _free(self, workers: Sequence[Worker]) -> int:
        """Requests ``workers`` (each with room) may take now, together."""
        return sum(self.room(worker) for worker in workers)

    def with_room(self, workers: Sequence[Worker]) -> list[Worker]:
        """The workers that may take a request now. With ``deweight_collapsed``, a worker flagged
        as collapsed (``app.workers.acceptance``) is one only while no other has room."""
        ready = [worker for worker in workers if self.has_room(worker)]
        if self._deweight and any(worker.accept.collapsed for worker in ready):
            preferred = [worker for worker in ready if not worker.accept.collapsed]
            if preferred:
                return preferred
        return ready

    def saturation(self, workers: Iterable[Worker]) -> float:
        """Fleet saturation, from 0 to 1: requests running or waiting on the routable workers
        plus this process's admission queue, over the routable workers' caps summed (1.0 = every
        slot taken, or more demand than slots: requests queue). With no routable worker: 1.0 if
        anything waits, else 0. Bounded by construction, so no figure a worker reports can push
        the autoscaling signal out of [0, 1]. With PD disaggregation only the decode workers
        count: their capacity bounds how many requests run (a prefill worker's is its own).
        """
        demand, capacity = self._queue.size, 0
        for worker in workers:
            if worker.routable and worker.role != "prefill":
                capacity += self.cap(worker)
                demand += max(worker.in_flight, worker.load.running + worker.load.waiting, 0)
        if demand <= 0:
            return 0.0
        if demand >= capacity:
            return 1.0
        return demand / capacity

    async def admit(
        self, candidates: Candidates, tenant: Tenant | None = None
    ) -> tuple[list[Worker], float]:
        """Candidates with room now, waiting in the queue if there are none yet (or if others
        already wait: a request never passes a waiter the queue would serve before it).

        ``tenant`` places the request in the queue: its priority class, and its key's lane and
        weight within the class (None: the default class, one shared lane). Returns the
        candidates with the seconds spent waiting. ``candidates`` is called again after every
        wake-up, so workers that became healthy or left meanwhile are seen. An empty list means
        no candidate exists at all (nothing to wait for)."""
        current = candidates()
        ready = self.with_room(current)
        queue = self._queue
        if not current or (ready and not queue.size and not self._granted):
            return ready, 0.0
        if tenant is None:
            waiter = Waiter(None, 1.0, _DEFAULT_CLASS)
        else:
            waiter = Waiter(tenant.name, tenant.policy.weight, tenant.priority)
        if queue.size >= self._config.queue_size:
            # Full: this request takes the place of the waiter served last if it would be served
            # before it (that one is refused as if it had come now), else it is refused.
            last = queue.displace(waiter)
            if last is None:
                raise self._refuse(_FULL)
            last.displaced = True
            if last.future is not None and not last.future.done():
                last.future.set_result(None)
        queue.push(waiter)
        if ready and self._granted < self._free(ready):
            # Room no granted waiter will take (e.g. two slots freed while one request waited):
            # the queue moves, in its order, rather than at the next re-check.
            self.release()
        start = self._clock()
        deadline = start + self._config.queue_timeout_s
        loop = asyncio.get_running_loop()
        try:
            while True:
                remaining = deadline - self._clock()
                if not waiter.granted and remaining > 0:
                    future = waiter.future = loop.create_future()
                    try:
                        # Wake on a granted slot; re-check at least every second for load and
                        # health changes.
                        async with asyncio.timeout(min(remaining, 1.0)):
                            await future
                    except TimeoutError:
                        pass
                if waiter.displaced:
                    raise self._refuse(_FULL)
                current = candidates()
                ready = self.with_room(current)
                if waiter.granted:
                    waiter.granted = False
                    self._granted -= 1
                    if ready or not current:
                        return ready, self._clock() - start
                    # A slot this request cannot use (e.g. on a worker it already tried): pass
                    # the wake-up on, then wait again at the front of its lane.
                    self._pass_on(waiter.hops)
                    queue.push(waiter, front=True)
                elif not current:
                    queue.remove(waiter)
                    return [], self._clock() - start
                elif ready and self._granted < self._free(ready):
                    # Room that no freed slot announced (polled load fell, a worker came back).
                    self.release()
                    continue
                if self._clock() >= deadline:
                    raise self._refuse("timed out waiting for a worker with capacity")
        except BaseException:
            # Timed out, or ended from outside (the client left): out of the queue at once, and a
            # slot granted meanwhile goes to the next waiter.
            if waiter.granted:
                waiter.granted = False
                self._granted -= 1
                self._pass_on(waiter.hops)
            else:
                queue.remove(waiter)
            raise

    def release(self, hops: int = 0) -> None:
        """A slot was freed (or capacity appeared): grant it to the waiter served next."""
        if not self._queue.size:
            return
        waiter = self._queue.pop()
        if waiter is None:
            return
        waiter.granted = True
        waiter.hops = hops
        self._granted += 1
        future = waiter.future
        if future is not None and not future.done():
            future.set_result(None)

    def _pass_on(self, hops: int) -> None:
        """Hand a wake-up its waiter could not use to the next one, through each waiter at most
        once."""
        if hops < self._queue.size:
            self.release(hops + 1)

    def _refuse(self, message: str) -> ServiceUnavailable:
        return ServiceUnavailable(message, retry_after=self._config.retry_after_s)
