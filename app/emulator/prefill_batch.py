"""A worker's prefill compute: one forward pass at a time, shared by every waiting prompt.

A GPU does not prefill many prompts side by side for free. SGLang's scheduler takes the waiting
requests in order into one prefill batch of at most ``--max-prefill-tokens`` new tokens (a longer
prompt goes alone), runs that forward pass, then the next batch. So ten 30k-token prompts that
arrive together finish one after another, the tenth after ten prefills' time, and where a
fleet's routing sends its uncached prompt tokens decides how long they wait: the cost the prefix
cache and a balanced fleet save.

A batch takes ``Timing.prefill_s(new tokens of the whole batch)``: one request alone costs what
it always did; requests arriving together share the pass's fixed cost and queue for its
per-token one. A request whose client left while it waited is dropped from the queue; once its
batch runs it costs the pass its tokens, as on a GPU.

A prompt's cached prefix is matched when its batch is formed, not when it arrived (SGLang
matches a waiting request against the radix cache as the scheduler takes it into a batch): the
``start`` callback does it, after the previous pass's prompts entered the cache, so sessions
that arrive together behind one that carries their shared system prompt find it cached.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable

from app.emulator.engine import Timing

# SGLang's default --max-prefill-tokens.
DEFAULT_MAX_PREFILL_TOKENS = 16384


class PrefillBatcher:
    def __init__(
        self,
        timing: Timing,
        max_tokens: int = DEFAULT_MAX_PREFILL_TOKENS,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        if max_tokens < 1:
            raise ValueError("max_prefill_tokens must be >= 1")
        self._timing = timing
        self._sleep = sleep
        self._max_tokens = max_tokens
        self._waiting: deque[tuple[int, Callable[[], int], asyncio.Future[None]]] = deque()
        self._task: asyncio.Task[None] | None = None
        self.waiting_tokens = 0  # new tokens queued for a pass, not yet running
        self.requests = 0  # prompts queued or in the pass running now: not decoding yet

    async def prefill(self, tokens: int, start: Callable[[], int] | None = None) -> None:
        """Return once a forward pass has prefilled this prompt's new tokens: ``tokens`` while
        it waits (what the queue reports), or what ``start`` returns when its batch is formed
        (matching the cache then)."""
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.append((tokens, start or (lambda: tokens), done))
        self.waiting_tokens += tokens
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._passes())
        self.requests += 1
        try:
            await done
        finally:
            self.requests -= 1

    async def _passes(self) -> None:
        waiting = self._waiting
        while waiting:
            batch: list[asyncio.Future[None]] = []
            total = 0
            while waiting and (not batch or total + waiting[0][0] <= self._max_tokens):
                tokens, start, done = waiting.popleft()
                self.waiting_tokens -= tokens
                if done.done():  # its client left while it waited
                    continue
                batch.append(done)
                total += start()
            if not batch:
                continue
            await self._sleep(self._timing.prefill_s(total))
            for done in batch:
                if not done.done():
                    done.set_result(None)
            # Let the batch's requests put their prompts into the cache before the next batch
            # is matched against it (each resumes in the order its future was set).
            await asyncio.sleep(0)
