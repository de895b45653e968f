"""CancelScope (``app.proxy.cancel``): a block that something outside it ends, raising ``Ended``
with the first reason where the block ends, and leaving any other cancellation as it is."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest

from app.outcomes import Outcome
from app.proxy.cancel import CancelScope, Ended


@contextlib.asynccontextmanager
async def running(cancel: CancelScope) -> AsyncIterator[None]:
    """The block under ``cancel``, entered and left as the proxy does."""
    task = asyncio.current_task()
    assert task is not None
    cancel.enter(task)
    try:
        yield
    except BaseException as exc:
        cancel.exit(type(exc))
        raise
    cancel.exit(None)


async def test_a_cancel_scope_ends_only_while_it_runs_and_keeps_the_first_reason() -> None:
    cancel = CancelScope()
    assert not cancel.end(Outcome.TIMEOUT)  # not entered yet: nothing to end

    async def block() -> None:
        async with running(cancel):
            assert cancel.end(Outcome.CLIENT_DISCONNECT)
            assert not cancel.end(Outcome.UPSTREAM_TIMEOUT)
            await asyncio.sleep(3600)

    with pytest.raises(Ended) as ended:
        await block()
    assert ended.value.reason is Outcome.CLIENT_DISCONNECT
    assert not cancel.end(Outcome.TIMEOUT)  # left: nothing to end


async def test_a_cancel_scope_its_own_block_ended_and_left_leaves_no_cancellation_behind() -> None:
    cancel = CancelScope()
    async with running(cancel):
        assert cancel.end(Outcome.TIMEOUT)  # the block ends before the end takes effect
    await asyncio.sleep(0)  # the request goes on: nothing left pending to cancel it here
    assert asyncio.current_task().cancelling() == 0  # type: ignore[union-attr]


async def test_a_cancellation_from_elsewhere_passes_through_an_ended_cancel_scope() -> None:
    cancel = CancelScope()
    entered = asyncio.Event()

    async def block() -> None:
        async with running(cancel):
            entered.set()
            await asyncio.sleep(3600)

    task = asyncio.create_task(block())
    await entered.wait()
    assert cancel.end(Outcome.CLIENT_DISCONNECT)
    task.cancel()  # the server shutting down at the same moment
    with pytest.raises(asyncio.CancelledError):
        await task
