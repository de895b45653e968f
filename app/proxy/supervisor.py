"""Everything time- or disconnect-driven about one proxied request.

``Supervisor`` does, per request (with one timer and a pending ``receive()``, no task of its
own), so the relay itself carries no per-chunk timers: it notices the client going away (ASGI
``http.disconnect``), sends ``: keep-alive`` after ``keepalive_s`` of silence on a stream, and
enforces the first-byte / idle / total deadlines. It ends things through the objects that own
them: a first-byte or idle deadline ends the running ``Attempt`` (aborted on its worker, then
stopped: it fails like any attempt); the total deadline or the client leaving aborts the running
attempt on its worker and then ends the request's ``CancelScope`` (``app.proxy.cancel``), which
raises ``Ended`` with the reason where the proxy runs it. Once the request was written the worker
hears "abort" before its connection drops.

It never waits for the client. A client that is behind (it stopped reading, the buffers on the
way are full, the worker's connection is paused: ``Downstream.behind``) gets no keep-alive (it has
bytes to read), and the time its worker waits for it is not the worker's silence: each wake that
finds it behind marks the attempt ``held``, so the idle deadline counts from there and never
blames the worker for it. A client that takes nothing for ``idle_s`` while it is behind is hung
up on: its attempt is aborted (no verdict on the worker) and the scope ends with
``CLIENT_TOO_SLOW``. The total deadline fires on time whatever the client does; it is a fault of
the worker's only if the worker had not answered by then (a client can fall behind where the
gateway cannot see it, in the kernel's buffers: a streaming worker is never blamed for it).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Coroutine
from typing import Any

from app.outcomes import Outcome
from app.proxy.attempt import Attempt
from app.proxy.cancel import CancelScope
from app.proxy.config import TimeoutConfig
from app.proxy.downstream import Clock, Downstream, Message, Receive

log = logging.getLogger(__name__)


class Supervisor:
    """Watches one request: client disconnect, keep-alive, deadlines. See the module doc.

    No task of its own while all is well: a pending ``receive()`` (for the disconnect) and one
    timer (the next deadline or keep-alive), re-armed when it fires. Only the rare actions that
    must await (an abort on the worker) run as a short task; a keep-alive that must go through
    ASGI ``send`` (the stream not started yet, or no direct lane) runs as a task of its own that
    nothing waits for."""

    def __init__(
        self,
        *,
        receive: Receive,
        downstream: Downstream,
        timeouts: TimeoutConfig,
        clock: Clock,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        self._receive = receive
        self._down = downstream
        self._clock = clock
        self.clock = clock
        self._keepalive_s = timeouts.keepalive_s if downstream.stream else None
        self.first_byte_s = timeouts.first_byte_s
        self.idle_s = timeouts.idle_s
        now = clock()
        self._total_deadline = now + timeouts.total_s if timeouts.total_s else None
        # The request's work: ended on the total deadline or a disconnect.
        self.cancel_scope = CancelScope()
        self.attempt: Attempt | None = None  # the upstream attempt running now, if any
        self._last_rx = now  # the last upstream chunk of the attempts that ended
        self.closed = False
        self.disconnected = False
        # The request's task (a ``CancelScope`` needs it) and its loop. ``loop``, when the caller
        # knows it, spares the running loop's look-up: a getpid() system call on Python < 3.12.
        task = asyncio.current_task(loop) if loop is not None else None
        if task is None:
            task = asyncio.current_task()
        assert task is not None, "a Supervisor is made inside the request's task"
        self.task = task
        self._loop = task.get_loop()
        self._listening: asyncio.Future[Message] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._wake_at = float("inf")  # when the timer fires (clock time)
        self._action: asyncio.Task[None] | None = None  # an abort under way
        self._pinging: asyncio.Task[None] | None = None  # a keep-alive going through ``send``
        # The client behind and taking nothing since ``_stall_since``; what it had then: the
        # upstream bytes' last arrival and the bytes it had still to read.
        self._stall_since: float | None = None
        self._stall_mark = (0.0, 0)

    def start(self) -> None:
        direct = self._down.direct_lane
        if direct is not None:
            direct.watch(self._gone_now)  # the server tells us; no receive() task needed
        else:
            self._listen()
        self._arm()

    async def stop(self) -> None:
        self.closed = True
        self._disarm()
        if self._down.direct_lane is not None:
            self._down.direct_lane.unwatch()
        if self._listening is not None:
            self._listening.cancel()
            self._listening = None
        for task in (self._action, self._pinging):
            if task is not None and not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._action = self._pinging = None

    # The attempts (called by ``Attempt``)

    def begin(self, attempt: Attempt) -> None:
        self.attempt = attempt
        self._arm_before(attempt.deadline())  # its first-byte deadline

    def responded(self) -> None:
        """The attempt's response has begun: the idle deadline replaces the first-byte one."""
        attempt = self.attempt
        if attempt is not None:
            self._arm_before(attempt.deadline())

    def finish(self, attempt: Attempt) -> None:
        if self.attempt is attempt:
            self.attempt = None
            self._last_rx = attempt.last_rx
            if self._timer is None:  # nothing armed (a deadline ended it): supervise on
                self._arm()

    # The client

    def _listen(self) -> None:
        listening = self._listening = asyncio.ensure_future(self._receive())
        listening.add_done_callback(self._received)

    def _received(self, listening: asyncio.Future[Message]) -> None:
        if self.closed or listening.cancelled():
            return
        try:
            gone = listening.result().get("type") == "http.disconnect"
        except Exception:  # a receive that fails means the client is unreachable
            gone = True
        if not gone:
            self._listen()
            return
        self._gone_now()

    def _gone_now(self) -> None:
        if self.closed or self.disconnected:
            return
        self.disconnected = True
        self._disarm()
        self._act(self._gone())

    # Deadlines and keep-alives

    def _deadline(self) -> float:
        total = self._total_deadline or float("inf")
        attempt = self.attempt
        return total if attempt is None else min(attempt.deadline(), total)

    def _quiet_since(self) -> float:
        attempt = self.attempt
        last_rx = self._last_rx if attempt is None else attempt.last_rx
        return max(last_rx, self._down.last_tx)

    def _next_wake(self) -> float:
        wake = self._deadline()
        if self._keepalive_s is not None:
            wake = min(wake, self._quiet_since() + self._keepalive_s)
        if self._stall_since is not None:
            wake = min(wake, self._stall_since + self.idle_s)
        return wake

    def _arm(self) -> None:
        self._disarm()
        if (
            self.closed
            or self.disconnected
            or self._action is not None
            or self.cancel_scope.reason is not None
        ):
            return
        wake = self._wake_at = self._next_wake()
        if wake != float("inf"):
            self._timer = self._loop.call_later(max(0.0, wake - self._clock()), self._wake)

    def _arm_before(self, wake: float) -> None:
        """A new deadline at ``wake``: the timer is moved to it only if it is nearer. (The timer
        already covers every other wake; one that fires before a later deadline finds nothing
        due and re-arms for what is next.)"""
        if wake < self._wake_at:
            self._arm()

    def _disarm(self) -> None:
        self._wake_at = float("inf")
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _wake(self) -> None:
        self._timer = None
        self._wake_at = float("inf")
        if self.closed or self._action is not None:
            return
        now = self._clock()
        behind = self._down.behind()
        if behind:
            if self._stalled(now):
                self._act(self._too_slow())
                return
        else:
            self._stall_since = None
        if now >= self._deadline():
            self._act(self._timeout())
            return
        if self._keepalive_s is not None and now - self._quiet_since() >= self._keepalive_s:
            self._keepalive(behind)
        self._arm()  # else woken early: data or a keep-alive moved the wake time on

    def _stalled(self, now: float) -> bool:
        """The client is behind: hold the worker blameless for the wait; True once the client has
        taken nothing for ``idle_s`` (no upstream bytes moved on, no fewer bytes waiting)."""
        attempt = self.attempt
        if attempt is not None:
            attempt.held = now
        mark = (self._last_rx if attempt is None else attempt.last_rx, self._down.pending())
        since, (last_rx, pending) = self._stall_since, self._stall_mark
        if since is None or mark[0] != last_rx or mark[1] < pending:
            self._stall_since, self._stall_mark = now, mark  # it took something since
            return False
        return now - since >= self.idle_s

    def _keepalive(self, behind: bool) -> None:
        """``: keep-alive`` unless the client is behind (it has bytes to read) or one is still
        on its way; never waits for the client."""
        down = self._down
        pinging = self._pinging
        if behind or (pinging is not None and not pinging.done()):
            down.last_tx = self._clock()
        elif not down.keepalive_now():
            pinging = self._pinging = self._loop.create_task(down.keepalive())
            pinging.add_done_callback(self._pinged)

    def _pinged(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.warning("keep-alive not sent", exc_info=task.exception())

    def _act(self, action: Coroutine[Any, Any, None]) -> None:
        task = self._action = self._loop.create_task(action)
        task.add_done_callback(self._acted)

    def _acted(self, task: asyncio.Task[None]) -> None:
        if self._action is task:
            self._action = None
        if not task.cancelled() and task.exception() is not None:
            log.error("request supervision failed", exc_info=task.exception())

    async def _gone(self) -> None:
        attempt = self.attempt
        if attempt is not None and not self.closed:
            await attempt.abort(Outcome.CANCELLED)
        self.cancel_scope.end(Outcome.CLIENT_DISCONNECT)

    async def _too_slow(self) -> None:
        attempt = self.attempt
        if attempt is not None and not self.closed:
            await attempt.abort(Outcome.CANCELLED)
        self.cancel_scope.end(Outcome.CLIENT_TOO_SLOW)

    async def _timeout(self) -> None:
        attempt = self.attempt
        total = self._total_deadline is not None and self._clock() >= self._total_deadline
        if total:  # the request is over: nothing more to supervise but the client
            if attempt is not None:
                # The request's own limit, not the worker's: a worker that answered and streams
                # (or waits for a client that is behind) is not at fault; one that never
                # answered in all that time is.
                await attempt.abort(Outcome.CANCELLED if attempt.receiving else Outcome.TIMEOUT)
            self.cancel_scope.end(Outcome.UPSTREAM_TIMEOUT)
            return
        if attempt is not None:
            await attempt.end(Outcome.TIMEOUT)
        self._action = None
        if attempt is None or self.attempt is not attempt:
            self._arm()  # else it is ending now: ``finish`` re-arms
