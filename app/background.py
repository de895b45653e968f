"""The gateway's background tasks, supervised: a task that crashes is restarted.

Health checks, load polling, discovery, the keys file watcher and (under ``--processes N``) the
gauges kept fresh for the other processes' scrapes each run as one asyncio task for the
gateway's life. An exception that escaped one of them used to end it silently and for good: a
worker's bad ``/v1/loads`` could stop load polling, or health checking, for the whole fleet
until a restart. ``supervise`` runs such a task's coroutine again after it raises (or returns,
which none of them should): the crash is logged with its traceback, counted
(``dflash_gateway_background_task_restarts_total{task}``), and the restart waits a capped
exponential backoff (``Backoff``: 0.5 s, 1 s, 2 s ... 30 s; back to the first step once a run
lasted ``reset_after_s``), so a task that fails at once does not spin. Cancellation (the
gateway stopping) ends it as before. The clock and the sleep are injected for tests.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)

Sleep = Callable[[float], Awaitable[None]]


@dataclass(frozen=True, slots=True)
class Backoff:
    first_s: float = 0.5
    max_s: float = 30.0
    # A run that lasted this long before it crashed restarts after ``first_s`` again.
    reset_after_s: float = 60.0

    def after(self, delay: float) -> float:
        """The wait after ``delay``: doubled, capped."""
        return min(delay * 2, self.max_s)


DEFAULT_BACKOFF = Backoff()


async def supervise(
    name: str,
    run: Callable[[], Awaitable[None]],
    restarted: Callable[[str], None],
    *,
    backoff: Backoff = DEFAULT_BACKOFF,
    clock: Callable[[], float] = time.monotonic,
    sleep: Sleep = asyncio.sleep,
) -> None:
    """Run ``run()`` until cancelled, again after each crash (``restarted(name)`` is told)."""
    delay = backoff.first_s
    while True:
        started = clock()
        try:
            await run()
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("background task %s crashed; restarting it", name)
        else:
            log.error("background task %s ended; restarting it", name)
        if clock() - started >= backoff.reset_after_s:
            delay = backoff.first_s
        try:
            restarted(name)
        except Exception:  # counting must not stop the restarts
            log.exception("background task %s: restart not counted", name)
        await sleep(delay)
        delay = backoff.after(delay)
