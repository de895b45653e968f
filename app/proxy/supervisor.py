"""Everything time- or disconnect-driven about one proxied request.

``Supervisor`` does, per request (with one timer and a pending ``receive()``, no task of its
own), so the relay itself carries no per-chunk timers: it notices the client going away (ASGI
``http.disconnect``), sends ``: keep-alive`` after ``keepalive_s`` of silence on a stream, and
enforces the first-byte / idle / total deadlines.
When the client goes away or a deadline passes it records why in ``reason`` and cancels the
request task; the proxy turns that into cleanup (close upstream) or a 504. Both first run
``abort_attempt`` (the proxy's abort of the running attempt on its worker), so the worker is told
before the upstream connection drops.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from app.config import TimeoutConfig
from app.proxy.downstream import Clock, Downstream, Message, Receive

log = logging.getLogger(__name__)

DISCONNECT = "client_disconnect"
TIMEOUT = "timeout"


class Supervisor:
    """Watches one request: client disconnect, keep-alive, deadlines. See the module doc.

    No task of its own while all is well: a pending ``receive()`` (for the disconnect) and one
    timer (the next deadline or keep-alive), re-armed when it fires. Only the rare actions that
    must await (an abort on the worker, a keep-alive sent through ASGI) run as a short task."""

    def __init__(
        self,
        *,
        task: asyncio.Task[Any],
        receive: Receive,
        downstream: Downstream,
        timeouts: TimeoutConfig,
        clock: Clock,
    ) -> None:
        self._task = task
        self._receive = receive
        self._down = downstream
        self._clock = clock
        self.clock = clock
        self._keepalive_s = timeouts.keepalive_s if downstream.stream else None
        self._first_byte_s = timeouts.first_byte_s
        self._idle_s = timeouts.idle_s
        now = clock()
        self._total_deadline = now + timeouts.total_s if timeouts.total_s else None
        self._attempt_start = now
        self.attempting = False  # deadlines apply only while an upstream attempt runs
        self.receiving = False  # the current attempt has its response headers
        self.last_rx = now  # set by the relay on every upstream chunk (one clock read)
        self.reason: str | None = None
        self.closed = False
        self.disconnected = False
        # Set by the proxy while an upstream attempt runs: aborts it on its worker.
        self.abort_attempt: Callable[[], Awaitable[None]] | None = None
        self.attempt_aborted = False
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

    def begin_attempt(self) -> None:
        self._attempt_start = self.last_rx = self._clock()
        self.receiving = False
        self.attempting = True
        self.attempt_aborted = False
        self._arm()  # the first-byte deadline may be nearer than the current timer

    def headers_received(self) -> None:
        """The attempt's response has begun: the idle deadline replaces the first-byte one."""
        self.receiving = True
        self.last_rx = self._clock()
        if self._next_wake() < self._wake_at:
            self._arm()

    def end_attempt(self) -> None:
        self.attempting = False
        self.abort_attempt = None

    def clear(self) -> None:
        """The request task has handled a timeout trip; keep supervising."""
        self.reason = None
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
        if not self.attempting:
            return self._total_deadline or float("inf")
        if self.receiving:
            deadline = self.last_rx + self._idle_s
        else:
            deadline = self._attempt_start + self._first_byte_s
        if self._total_deadline is not None:
            deadline = min(deadline, self._total_deadline)
        return deadline

    def _next_wake(self) -> float:
        wake = self._deadline()
        if self._keepalive_s is not None:
            wake = min(wake, max(self.last_rx, self._down.last_tx) + self._keepalive_s)
        return wake

    def _arm(self) -> None:
        self._disarm()
        if self.closed or self.disconnected or self._action is not None:
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
        elif (
            self._keepalive_s is not None
            and now - max(self.last_rx, self._down.last_tx) >= self._keepalive_s
        ):
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
        await self._abort_then_trip(DISCONNECT)

    async def _timeout(self) -> None:
        tripped = await self._abort_then_trip(TIMEOUT)
        self._action = None
        if not tripped:
            self._arm()

    async def _abort_then_trip(self, reason: str) -> bool:
        """Abort the running attempt on its worker, then cancel the request task."""
        abort, self.abort_attempt = self.abort_attempt, None
        if abort is not None and not self.closed:
            # Before the request task is cancelled: cancelling it mid-request drops the
            # upstream connection at once, and the worker should hear "abort", not a hang-up.
            self.attempt_aborted = True
            await abort()
            if reason == TIMEOUT and not self.attempting:
                return False  # the attempt finished meanwhile: nothing left to time out
        self._trip(reason)
        return True

    def _trip(self, reason: str) -> None:
        if not self.closed and self.reason is None:
            self.reason = reason
            self._task.cancel()
