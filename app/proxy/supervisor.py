"""Everything time- or disconnect-driven about one proxied request.

``Supervisor`` does, per request (with one timer and a pending ``receive()``, no task of its
own), so the relay itself carries no per-chunk timers: it notices the client going away (ASGI
``http.disconnect``), sends ``: keep-alive`` after ``keepalive_s`` of silence on a stream, and
enforces the first-byte / idle / total deadlines. It ends things through the objects that own
them: a first-byte or idle deadline ends the running ``Attempt`` (aborted on its worker, then
stopped: it fails like any attempt); the total deadline or the client leaving aborts the running
attempt on its worker and then ends the request's ``scope`` (``app.proxy.attempt.Scope``), which
raises ``Ended`` with the reason where the proxy runs it. The worker always hears "abort"
before its connection drops.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Coroutine
from typing import Any

from app.config import TimeoutConfig
from app.outcomes import Outcome
from app.proxy.attempt import Attempt, Scope
from app.proxy.downstream import Clock, Downstream, Message, Receive

log = logging.getLogger(__name__)


class Supervisor:
    """Watches one request: client disconnect, keep-alive, deadlines. See the module doc.

    No task of its own while all is well: a pending ``receive()`` (for the disconnect) and one
    timer (the next deadline or keep-alive), re-armed when it fires. Only the rare actions that
    must await (an abort on the worker, a keep-alive sent through ASGI) run as a short task."""

    def __init__(
        self,
        *,
        receive: Receive,
        downstream: Downstream,
        timeouts: TimeoutConfig,
        clock: Clock,
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
        self.scope = Scope()  # the request's work: ended on the total deadline or a disconnect
        self.attempt: Attempt | None = None  # the upstream attempt running now, if any
        self._last_rx = now  # the last upstream chunk of the attempts that ended
        self.closed = False
        self.disconnected = False
        self._loop = asyncio.get_running_loop()
        self._listening: asyncio.Future[Message] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._wake_at = float("inf")  # when the timer fires (clock time)
        self._action: asyncio.Task[None] | None = None  # an abort or keep-alive under way

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
        action, self._action = self._action, None
        if action is not None and not action.done():
            action.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await action

    # The attempts (called by ``Attempt``)

    def begin(self, attempt: Attempt) -> None:
        self.attempt = attempt
        self._arm()  # the first-byte deadline may be nearer than the current timer

    def responded(self) -> None:
        """The attempt's response has begun: the idle deadline replaces the first-byte one."""
        if self._next_wake() < self._wake_at:
            self._arm()

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
        return wake

    def _arm(self) -> None:
        self._disarm()
        if (
            self.closed
            or self.disconnected
            or self._action is not None
            or self.scope.reason is not None
        ):
            return
        wake = self._wake_at = self._next_wake()
        if wake != float("inf"):
            self._timer = self._loop.call_later(max(0.0, wake - self._clock()), self._wake)

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
        if now >= self._deadline():
            self._act(self._timeout())
        elif self._keepalive_s is not None and now - self._quiet_since() >= self._keepalive_s:
            self._act(self._keepalive())
        else:
            self._arm()  # woken early: data or a keep-alive moved the wake time on

    def _act(self, action: Coroutine[Any, Any, None]) -> None:
        task = self._action = self._loop.create_task(action)
        task.add_done_callback(self._acted)

    def _acted(self, task: asyncio.Task[None]) -> None:
        if self._action is task:
            self._action = None
        if not task.cancelled() and task.exception() is not None:
            log.error("request supervision failed", exc_info=task.exception())

    async def _keepalive(self) -> None:
        try:
            await self._down.keepalive()
        finally:
            self._action = None
        self._arm()

    async def _gone(self) -> None:
        attempt = self.attempt
        if attempt is not None and not self.closed:
            await attempt.abort(Outcome.CANCELLED)
        self.scope.end(Outcome.CLIENT_DISCONNECT)

    async def _timeout(self) -> None:
        attempt = self.attempt
        total = self._total_deadline is not None and self._clock() >= self._total_deadline
        if total:  # the request is over: nothing more to supervise but the client
            if attempt is not None:
                await attempt.abort(Outcome.TIMEOUT)
            self.scope.end(Outcome.UPSTREAM_TIMEOUT)
            return
        if attempt is not None:
            await attempt.end(Outcome.TIMEOUT)
        self._action = None
        if attempt is None or self.attempt is not attempt:
            self._arm()  # else it is ending now: ``finish`` re-arms
