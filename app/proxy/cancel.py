"""CancelScope: a block of a request's work that something outside it ends (a deadline, the client
leaving), raising ``Ended`` with the reason where the block ends. A general cancellation primitive:
the request's ``Supervisor`` owns one per request, an ``Attempt`` one per try.
"""

from __future__ import annotations

import asyncio
from typing import Any

from app.outcomes import Outcome


class Ended(Exception):
    """A ``CancelScope`` was ended from outside; raised where the block ends, with the reason."""

    def __init__(self, reason: Outcome) -> None:
        super().__init__(reason.value)
        self.reason = reason


class CancelScope:
    """A block of a request's work that a deadline or the client leaving ends from outside, at
    whatever the block awaits: ``end(reason)`` makes the block raise ``Ended(reason)`` where it
    ends. A cancellation from anywhere else (the server shutting down) passes through unchanged.
    Ending a scope that is not running (not yet entered, or already left) does nothing.

    What ``asyncio.Timeout`` does at its deadline, without the deadline: ``end`` has the task
    running the block cancelled (from the event loop, as a timer would: never in the midst of the
    code that called ``end``), and on the way out the block's own cancellation (counted by
    ``Task.cancel``/``uncancel``) becomes ``Ended``; any other one is left as it is. Entering and
    leaving cost a few attribute writes and no timer."""

    __slots__ = ("_cancelled", "_cancelling", "_pending", "_task", "reason")

    def __init__(self) -> None:
        self._task: asyncio.Task[Any] | None = None
        self._cancelling = 0
        self._pending: asyncio.Handle | None = None  # the cancel, scheduled by ``end``
        self._cancelled = False  # the cancel was made
        self.reason: Outcome | None = None

    @property
    def running(self) -> bool:
        return self._task is not None

    def enter(self, task: asyncio.Task[Any]) -> None:
        """The block begins, run by ``task``; ``exit(exc_type)`` when it ends, whatever it
        raised (plain calls, not ``async with``: no coroutine in or out)."""
        assert self.reason is None and not self._cancelled, "a CancelScope is entered once"
        self._task, self._cancelling = task, task.cancelling()

    def exit(self, exc_type: type[BaseException] | None) -> None:
        """The block ended (``exc_type``: what it raised): raises ``Ended`` if it was ended."""
        task, self._task = self._task, None
        assert task is not None
        if self._pending is not None:  # ended, and left before the cancel was made
            self._pending.cancel()
            self._pending = None
        # The block's own cancellation: taken back whatever the block raised, and turned into
        # ``Ended`` unless another cancellation is pending too.
        mine = self._cancelled and task.uncancel() <= self._cancelling
        if mine and exc_type is asyncio.CancelledError:
            raise Ended(self.reason or Outcome.CANCELLED) from None

    def end(self, reason: Outcome) -> bool:
        """End the block (the first reason wins). False if it is not running or already ended."""
        task = self._task
        if task is None or self.reason is not None:
            return False
        self.reason = reason
        self._pending = task.get_loop().call_soon(self._cancel)
        return True

    def _cancel(self) -> None:
        self._pending = None
        task = self._task
        if task is not None:
            self._cancelled = True
            task.cancel()
