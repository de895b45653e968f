"""The emulated scheduler: capacity (running + waiting), step timing, the live request registry.

Latency model (seconds, divided by ``--speed``, times ``--step-time-scale``: a slower GPU or a
hot node): a verify step takes ``(step_base_s + step_per_running_s * running) * profile_factor``
(~21 ms alone, ~60 ms at 32 running on average: DFLASH.md's ~3x growth from C=1 to C=32 and
the seed's Kimi-K2.5 55-85 ms; the per-profile factor, see ``profiles.step_time_factors``,
reproduces the seed's tok/s at C=32), prefill takes
``prefill_base_s + prefill_per_token_s * uncached``.
Beyond ``max_running`` requests wait in FIFO order; beyond ``max_queued`` waiting ones a new
request is refused with SGLang's "The request queue is full.".

Priority (SGLang 0.5.23, ``managers/scheduler.py`` ``_set_or_validate_priority`` and
``_abort_on_queued_limit``, ``managers/schedule_policy.py`` ``_sort_by_priority_and_fcfs``): with
``--enable-priority-scheduling`` waiting requests are served by their ``priority`` field, larger
first, then in arrival order; a request without one counts as the lowest. A full waiting queue
then makes room for a request of strictly higher priority by aborting its least preferred waiter
(lowest priority, newest) with "The request is aborted by a higher priority request.". Without
the flag ``priority`` is accepted and ignored (FIFO), unless ``--abort-on-priority-when-disabled``:
then a request carrying it is aborted with a 503. Running requests are never preempted: SGLang
only preempts for a priority difference above ``--priority-scheduling-preemption-threshold``
(10), and the gateway's classes differ by at most 2.
"""

from __future__ import annotations

import asyncio
import itertools
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol


class Clock(Protocol):
    def monotonic(self) -> float: ...

    def time(self) -> float: ...


class SystemClock:
    def monotonic(self) -> float:
        return time.monotonic()

    def time(self) -> float:
        return time.time()


@dataclass(frozen=True)
class Timing:
    speed: float = 1.0
    step_base_s: float = 0.0195
    step_per_running_s: float = 0.00126
    prefill_base_s: float = 0.03
    prefill_per_token_s: float = 0.00005
    scale: float = 1.0  # this node's slowdown: every verify step and prefill takes scale x as long

    def step_s(self, running: int, factor: float = 1.0) -> float:
        step = self.step_base_s + self.step_per_running_s * running
        return step * factor * self.scale / self.speed

    def prefill_s(self, uncached_tokens: int) -> float:
        prefill = self.prefill_base_s + self.prefill_per_token_s * uncached_tokens
        return prefill * self.scale / self.speed


class QueueFull(Exception):
    """The scheduler refused (or evicted) the request: answered with SGLang's 503 abort."""

    def __init__(self, message: str = "The request queue is full.") -> None:
        super().__init__(message)
        self.message = message


PRIORITY_DISABLED = (
    "Using priority is disabled for this server. Please send a new request without a priority."
)
EVICTED = "The request is aborted by a higher priority request."
LOWEST_PRIORITY = -sys.maxsize - 1  # a request without ``priority`` under priority scheduling


@dataclass(eq=False)
class ActiveRequest:
    """A request the worker knows about, from admission until it finishes."""

    rid: str
    profile: str
    stream: bool
    started: float
    started_mono: float
    priority: int | None = None  # SGLang's ``priority`` field
    aborted: str | None = None  # "abort" (abort_request) or "disconnect"
    seq: int = 0  # arrival order in the waiting queue
    _wake: asyncio.Event = field(default_factory=asyncio.Event)
    _slot: asyncio.Future[None] | None = None

    def abort(self, reason: str) -> bool:
        if self.aborted is not None:
            return False
        self.aborted = reason
        self._wake.set()
        if self._slot is not None and not self._slot.done():
            self._slot.cancel()
        return True

    async def wait_aborted(self) -> None:
        await self._wake.wait()


class Scheduler:
    """Running/waiting bookkeeping and the registry ``/abort_request`` searches by rid prefix."""

    def __init__(
        self,
        max_running: int,
        max_queued: int | None,
        *,
        priority_scheduling: bool = False,
        abort_on_priority: bool = False,
    ) -> None:
        self.max_running = max_running
        self.max_queued = max_queued
        self.priority_scheduling = priority_scheduling
        self.abort_on_priority = abort_on_priority
        self._arrivals = itertools.count()
        self.running = 0
        self._waiting: deque[ActiveRequest] = deque()
        self.active: dict[int, ActiveRequest] = {}

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def register(self, req: ActiveRequest) -> None:
        self.active[id(req)] = req

    def unregister(self, req: ActiveRequest) -> None:
        self.active.pop(id(req), None)

    async def acquire(self, req: ActiveRequest) -> bool:
        """Take a running slot; False if the request was aborted while waiting. ``QueueFull``
        when refused (or, waiting, evicted by a request of higher priority)."""
        if not self.priority_scheduling:
            if req.priority is not None and self.abort_on_priority:
                raise QueueFull(PRIORITY_DISABLED)
        elif req.priority is None:
            req.priority = LOWEST_PRIORITY
        if self.running < self.max_running and not self._waiting:
            self.running += 1
            return True
        if self.max_queued is not None and len(self._waiting) >= self.max_queued:
            self._make_room(req)
        req.seq = next(self._arrivals)
        req._slot = asyncio.get_running_loop().create_future()
        self._waiting.append(req)
        try:
            await req._slot
            return True
        except asyncio.CancelledError:
            if req.aborted is None:
                raise
            return False
        finally:
            req._slot = None
            if req in self._waiting:
                self._waiting.remove(req)

    def _make_room(self, req: ActiveRequest) -> None:
        """The waiting queue is full: refuse ``req``, or (priority scheduling) evict the least
        preferred waiter if ``req`` ranks strictly above it."""
        if not self.priority_scheduling or not self._waiting:
            raise QueueFull
        victim = min(self._waiting, key=lambda w: (w.priority or 0, -w.seq))
        if (req.priority or 0) <= (victim.priority or 0):
            raise QueueFull
        self._waiting.remove(victim)
        if victim._slot is not None and not victim._slot.done():
            victim._slot.set_exception(QueueFull(EVICTED))

    def _next(self) -> ActiveRequest:
        if not self.priority_scheduling:
            return self._waiting.popleft()
        best = max(self._waiting, key=lambda w: (w.priority or 0, -w.seq))
        self._waiting.remove(best)
        return best

    def release(self) -> None:
        while self._waiting:
            nxt = self._next()
            if nxt._slot is not None and not nxt._slot.done():
                nxt._slot.set_result(None)  # the slot passes on; running stays the same
                return
        self.running -= 1

    def abort(self, rid: str, abort_all: bool = False) -> int:
        """Abort every request whose rid starts with ``rid`` (all if ``abort_all``)."""
        if not abort_all and not rid:
            return 0
        count = 0
        for req in list(self.active.values()):
            if (abort_all or req.rid.startswith(rid)) and req.abort("abort"):
                count += 1
        return count


class RateWindow:
    """Generation throughput and accept length over the last completed window (>= ``period_s``),
    like SGLang's gauges that report the last logging interval."""

    def __init__(self, clock: Clock, period_s: float = 1.0) -> None:
        self._clock = clock
        self._period = period_s
        self._start = clock.monotonic()
        self._tokens = 0
        self._steps = 0
        self.throughput = 0.0
        self.accept_length = 0.0

    def add(self, tokens: int, steps: int) -> None:
        self._tokens += tokens
        self._steps += steps

    def roll(self) -> None:
        now = self._clock.monotonic()
        elapsed = now - self._start
        first = self.accept_length == 0.0 and self._steps > 0
        if elapsed <= 0 or (elapsed < self._period and not first):
            return
        self.throughput = self._tokens / elapsed
        if self._steps:
            self.accept_length = self._tokens / self._steps
        self._start = now
        self._tokens = 0
        self._steps = 0
