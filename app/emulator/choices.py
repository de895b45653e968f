"""The choices of one HTTP request (``n`` samples of each prompt of a batch) run side by side.

Each choice is its own ``Session``: its own request id, running slot, verify steps and ground-truth
record. A stream interleaves their outputs in the order they are produced, as SGLang's
``TokenizerManager._stream_batch_responses`` does (``asyncio.wait(FIRST_COMPLETED)`` over one
pending ``__anext__`` per generation, tagging each output with its choice index). Usage adds the
choices up as ``UsageProcessor`` does (``serving_*.py``, ``usage_processor.py``): completion and
reasoning tokens over all choices, prompt and cached tokens once per prompt (every ``n``-th
choice).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from app.emulator import render
from app.emulator.generation import Step
from app.emulator.session import Session


async def merged(sessions: list[Session]) -> AsyncIterator[tuple[Session, Step]]:
    """Every choice's verify steps, as they come."""
    if len(sessions) == 1:
        only = sessions[0]
        async for step in only.steps():
            yield only, step
        return
    iterators = {s: s.steps().__aiter__() for s in sessions}
    pending: dict[asyncio.Future[Step], Session] = {
        asyncio.ensure_future(it.__anext__()): s for s, it in iterators.items()
    }
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=lambda t: pending[t].req.index):
                session = pending.pop(task)
                try:
                    step = task.result()
                except StopAsyncIteration:
                    continue
                yield session, step
                pending[asyncio.ensure_future(iterators[session].__anext__())] = session
    finally:
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)


def usage(sessions: list[Session], *, drop_none: bool = False) -> dict[str, Any]:
    n = sessions[0].req.n
    counts = [s.usage_counts() for s in sessions]
    firsts = counts[::n]
    cached = None if firsts[0][3] is None else sum(c[3] or 0 for c in firsts)
    return render.usage(
        sum(c[0] for c in firsts),
        sum(c[1] for c in counts),
        sum(c[2] for c in counts),
        cached,
        drop_none=drop_none,
    )
