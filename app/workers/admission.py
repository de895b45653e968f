"""Admission control: a per-worker cap, and a bounded FIFO queue in front of it.

A worker runs at most its ``max_running_requests`` at once (48 for DFLASH unless set otherwise);
more only queue inside SGLang where the gateway can neither see nor re-route them. Each worker's
cap is the limit it reports in ``/v1/loads`` (learned when it is admitted to the pool and on every
loads poll; 48 until then), or ``admission.per_worker_cap`` for every worker when that is set.
The gateway admits a request to a worker only while

- this process has fewer than ``cap / processes`` requests in flight there, and
- the worker's own polled ``running + waiting`` (all gateway replicas and processes together)
  is below ``cap``.

When no candidate has room the request waits in a FIFO queue of at most ``queue_size`` entries
for up to ``queue_timeout_s``; a full queue answers 503 at once and a timed-out wait 503 too, both
with ``Retry-After`` (CONTRACTS.md). Every slot freed wakes the oldest waiter.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable, Iterable, Sequence

from app.config import AdmissionConfig
from app.errors import ServiceUnavailable
from app.workers.worker import Worker

Clock = Callable[[], float]
Candidates = Callable[[], Sequence[Worker]]


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
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()

    @property
    def depth(self) -> int:
        """Requests waiting for a slot now."""
        return len(self._waiters)

    def cap(self, worker: Worker) -> int:
        """The most requests ``worker`` may hold (all gateway processes together): the
        override, else what it reports."""
        return self._config.per_worker_cap or worker.capacity

    def has_room(self, worker: Worker) -> bool:
        cap = self.cap(worker)
        local = -(-cap // self._processes)  # ceil
        polled = worker.load.running + worker.load.waiting
        return worker.in_flight < local and polled < cap

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
        """Fleet saturation: requests running or waiting on the routable workers plus this
        process's admission queue, over the routable workers' caps summed (1.0 = every slot
        taken; above it, requests queue). With no routable worker: 1.0 if anything waits, else 0.
        """
        demand, capacity = len(self._waiters), 0
        for worker in workers:
            if worker.routable:
                capacity += self.cap(worker)
                demand += max(worker.in_flight, worker.load.running + worker.load.waiting)
        if capacity == 0:
            return 1.0 if demand else 0.0
        return demand / capacity

    async def admit(self, candidates: Candidates) -> tuple[list[Worker], float]:
        """Candidates with room now, waiting in the queue if there are none yet.

        Returns them with the seconds spent waiting. ``candidates`` is called again after every
        wake-up, so workers that became healthy or left meanwhile are seen. An empty list means
        no candidate exists at all (nothing to wait for)."""
        current = candidates()
        ready = self.with_room(current)
        if not current or (ready and not self._waiters):
            return ready, 0.0
        # Others are already waiting (or nothing has room): queue behind them, FIFO.
        if len(self._waiters) >= self._config.queue_size:
            raise self._refuse("every worker is at capacity and the admission queue is full")
        if ready:
            self.release()  # there is room: let the queue move
        start = self._clock()
        deadline = start + self._config.queue_timeout_s
        loop = asyncio.get_running_loop()
        while True:
            waiter: asyncio.Future[None] = loop.create_future()
            self._waiters.append(waiter)
            try:
                remaining = deadline - self._clock()
                if remaining <= 0:
                    raise TimeoutError
                # Wake on a freed slot; re-check at least every second for load/health changes.
                async with asyncio.timeout(min(remaining, 1.0)):
                    await waiter
            except TimeoutError:
                pass
            finally:
                if waiter in self._waiters:
                    self._waiters.remove(waiter)
            current = candidates()
            ready = self.with_room(current)
            if ready or not current:
                if not ready:
                    self.release()  # pass a wake-up we cannot use to the next waiter
                return ready, self._clock() - start
            if self._clock() >= deadline:
                raise self._refuse("timed out waiting for a worker with capacity")

    def release(self) -> None:
        """A slot was freed (or capacity appeared): wake the oldest waiter."""
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    def _refuse(self, message: str) -> ServiceUnavailable:
        return ServiceUnavailable(message, retry_after=self._config.retry_after_s)
