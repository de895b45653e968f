"""A client that stops reading a stream, served as `dflash-gateway serve` serves it.

The client reads the first event and then nothing: the buffers on the way fill, the gateway stops
reading the worker, the worker cannot get its stream out. Deadlines are read on a clock the test
moves (the supervisor's timer, armed on that clock, re-checks it every ``TICK`` real seconds), so
a deadline passes only when the test says so. What must hold: the worker is never blamed for the
wait (no timeout, no breaker fault), a client that reads nothing for ``idle_s`` is hung up on and
its request aborted on the worker, and the total deadline ends the request whatever the client
does.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import orjson
import pytest

from app.outcomes import Outcome
from app.workers.breaker import BreakerState
from tests.support.gateway import (
    MODEL,
    FakeWorker,
    GatewayHarness,
    Response,
    chat_chunks,
    wait_for,
)

CHAT = "/v1/chat/completions"
TICK = 0.2  # the deadlines, in the test clock's seconds (and the timer's real re-check period)
PIECE = "x" * (32 * 1024)
PIECES = 1024  # 32 MiB of stream: far more than the socket buffers on the way hold


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def access(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.INFO, logger="dflash_gateway.access")
    return caplog


def _logged(caplog: pytest.LogCaptureFixture) -> dict[str, Any]:
    (entry,) = [r for r in caplog.records if r.name == "dflash_gateway.access"]
    fields: dict[str, Any] = entry.fields  # type: ignore[attr-defined]
    return fields


def _attempts(gw: GatewayHarness, worker: FakeWorker, outcome: Outcome) -> float:
    labels = {"worker": worker.name, "outcome": outcome.value}
    value = gw.gateway.metrics.registry.get_sample_value(
        "dflash_gateway_upstream_attempts_total", labels
    )
    return value or 0.0


def _harness(worker: FakeWorker, clock: Clock, **timeouts: float) -> GatewayHarness:
    # One fault would open the worker's breaker.
    return GatewayHarness(
        [worker], clock=clock, timeouts=timeouts, breaker={"failure_threshold": 1}
    )


async def _stall(gw: GatewayHarness, worker: FakeWorker) -> tuple[Response, bytearray]:
    """Start a long stream, read its first event, then read nothing until the worker is stuck."""
    assert gw.client is not None
    body = orjson.dumps(
        {"model": MODEL, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    )
    response = await gw.client.open("POST", CHAT, body, {"content-type": "application/json"})
    got = bytearray()
    while b"\n\n" not in got:
        part = await response.read()
        assert part is not None
        got += part
    await wait_for(lambda: worker.stalled.is_set() or worker.finished.is_set(), timeout=30)
    assert not worker.finished.is_set()
    return response, got


async def _read_on(response: Response, got: bytearray) -> bool:
    """Read to the end; False if the gateway hung up first."""
    try:
        while (part := await response.read()) is not None:
            got += part
    except ConnectionError:
        return False
    return True


async def _advance_until(clock: Clock, done: Any, *, step: float = TICK) -> None:
    """Move the clock on a step per timer period until ``done()``."""
    async with asyncio.timeout(30):
        while not done():
            clock.now += step
            await asyncio.sleep(TICK)


async def test_a_client_that_stops_reading_is_not_the_workers_silence() -> None:
    """Paused for its client far past the idle deadline, the worker is not timed out: reading on,
    the client gets the whole stream, byte for byte, and the breaker heard a success."""
    clock = Clock()
    worker = FakeWorker(texts=(PIECE,) * PIECES)
    async with _harness(worker, clock, idle_s=TICK, keepalive_s=TICK) as gw:
        response, got = await _stall(gw, worker)
        clock.now += 5 * TICK  # five idle deadlines while the client reads nothing
        await asyncio.sleep(3 * TICK)  # the supervisor wakes (more than once) meanwhile
        assert await _read_on(response, got)
        assert gw.client is not None
        gw.client.done(response)
        assert not worker.aborted
        assert _attempts(gw, worker, Outcome.OK) == 1
        assert gw.gateway.pool.workers[0].breaker.state is BreakerState.CLOSED
    # Every byte, and nothing more: no error event, no keep-alive pushed in while the client had
    # bytes to read (the usage chunk the client did not ask for is dropped, as always).
    stream = chat_chunks(worker.requests[0]["rid"], worker.texts)
    assert bytes(got) == b"".join(stream[:-2]) + stream[-1]


async def test_a_client_that_reads_nothing_for_idle_s_is_hung_up_on(
    access: pytest.LogCaptureFixture,
) -> None:
    """No bytes taken for ``idle_s``: the gateway aborts the request on the worker (no fault of
    the worker's), frees its slot and drops the connection; the access line says why."""
    clock = Clock()
    worker = FakeWorker(texts=(PIECE,) * PIECES)
    async with _harness(worker, clock, idle_s=3 * TICK, keepalive_s=TICK) as gw:
        response, got = await _stall(gw, worker)
        await _advance_until(clock, lambda: worker.aborted)
        assert not await _read_on(response, got)  # hung up on: the stream never completes
        assert worker.aborted == [worker.requests[0]["rid"]]
        await wait_for(lambda: gw.gateway.pool.workers[0].in_flight == 0)
        assert _attempts(gw, worker, Outcome.CANCELLED) == 1
        assert _attempts(gw, worker, Outcome.TIMEOUT) == 0
        assert gw.gateway.pool.workers[0].breaker.state is BreakerState.CLOSED
        await wait_for(lambda: [r for r in access.records if r.name == "dflash_gateway.access"])
    fields = _logged(access)
    assert fields["outcome"] is Outcome.CLIENT_TOO_SLOW and fields["status"] == 499


async def test_the_total_deadline_ends_a_request_whose_client_reads_nothing(
    access: pytest.LogCaptureFixture,
) -> None:
    """The total deadline is not held up by a client that cannot even take the error event: the
    request ends on time, the worker is aborted without blame, the client is hung up on."""
    clock = Clock()
    worker = FakeWorker(texts=(PIECE,) * PIECES)
    async with _harness(worker, clock, idle_s=1000.0, keepalive_s=TICK, total_s=3 * TICK) as gw:
        response, got = await _stall(gw, worker)
        await _advance_until(clock, lambda: worker.aborted)
        assert not await _read_on(response, got)
        await wait_for(lambda: gw.gateway.pool.workers[0].in_flight == 0)
        assert _attempts(gw, worker, Outcome.CANCELLED) == 1
        assert _attempts(gw, worker, Outcome.TIMEOUT) == 0
        assert gw.gateway.pool.workers[0].breaker.state is BreakerState.CLOSED
        await wait_for(lambda: [r for r in access.records if r.name == "dflash_gateway.access"])
    fields = _logged(access)
    assert fields["outcome"] is Outcome.UPSTREAM_TIMEOUT and fields["status"] == 200
