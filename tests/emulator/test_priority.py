"""SGLang's ``priority`` field on the emulated worker: served larger first with
--enable-priority-scheduling (arrival order within a priority, no priority = lowest), a full
waiting queue evicting a lower priority for a higher one; ignored without the flag, or a 503 with
--abort-on-priority-when-disabled; a value that is not a 64-bit integer is a 400."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from app.emulator.engine import EVICTED, PRIORITY_DISABLED, ActiveRequest, QueueFull, Scheduler
from app.emulator.genrequest import RequestError
from app.emulator.requests import parse_chat
from tests.support.procs import PYTHON, ProcessManager


def _req(rid: str, priority: int | None) -> ActiveRequest:
    return ActiveRequest(rid, "gsm8k", True, 0.0, 0.0, priority)


async def _queue(scheduler: Scheduler, reqs: list[ActiveRequest]) -> list[asyncio.Future[bool]]:
    waiting = [asyncio.ensure_future(scheduler.acquire(r)) for r in reqs]
    await asyncio.sleep(0)
    return waiting


async def _served(scheduler: Scheduler, reqs: list[ActiveRequest]) -> list[str]:
    """Queue ``reqs`` behind a running request, then free one slot at a time."""
    assert await scheduler.acquire(_req("running", None))
    waiting = await _queue(scheduler, reqs)
    order: list[str] = []
    for _ in reqs:
        scheduler.release()
        await asyncio.sleep(0)
        for req, fut in zip(reqs, waiting, strict=True):
            if fut.done() and req.rid not in order:
                order.append(req.rid)
    return order


async def test_priority_scheduling_serves_larger_priorities_first_then_in_arrival_order() -> None:
    scheduler = Scheduler(1, None, priority_scheduling=True)
    reqs = [_req("none", None), _req("low-1", 0), _req("high", 2), _req("low-2", 0)]
    assert await _served(scheduler, reqs) == ["high", "low-1", "low-2", "none"]


async def test_without_priority_scheduling_the_field_is_ignored() -> None:
    scheduler = Scheduler(1, None)
    reqs = [_req("a", 0), _req("b", 2), _req("c", None)]
    assert await _served(scheduler, reqs) == ["a", "b", "c"]


async def test_abort_on_priority_when_disabled_refuses_the_field() -> None:
    scheduler = Scheduler(1, None, abort_on_priority=True)
    with pytest.raises(QueueFull) as info:
        await scheduler.acquire(_req("a", 1))
    assert info.value.message == PRIORITY_DISABLED
    assert await scheduler.acquire(_req("b", None))


async def test_a_full_queue_evicts_a_lower_priority_for_a_higher_one() -> None:
    scheduler = Scheduler(1, 2, priority_scheduling=True)
    assert await scheduler.acquire(_req("running", None))
    low_old, low_new = _req("low-old", 0), _req("low-new", 0)
    waiting = await _queue(scheduler, [low_old, low_new])
    high = asyncio.ensure_future(scheduler.acquire(_req("high", 2)))
    await asyncio.sleep(0)
    with pytest.raises(QueueFull) as info:
        await waiting[1]  # the newest of the lowest goes
    assert info.value.message == EVICTED
    assert not waiting[0].done() and not high.done()
    with pytest.raises(QueueFull) as refused:  # equal priority: the newcomer is refused
        await scheduler.acquire(_req("low-late", 0))
    assert refused.value.message == "The request queue is full."
    scheduler.release()
    assert await high is True


def test_priority_must_be_a_64_bit_integer() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    assert parse_chat({**body, "priority": 2}).priority == 2
    assert parse_chat(body).priority is None
    for bad in ("high", 1.5, True, 1 << 63):
        with pytest.raises(RequestError, match="signed 64-bit integer"):
            parse_chat({**body, "priority": bad})


def test_real_process_orders_its_queue_by_priority(tmp_path: Path) -> None:
    """One running slot held by the gate; three requests wait; released, they run high first and
    the worker reports the flag and each request's priority."""
    procs = ProcessManager(tmp_path)
    try:
        emu = procs.start(
            [
                *(PYTHON, "-m", "app", "emulate", "--port", "{port}", "--speed", "50"),
                *("--max-running-requests", "1", "--enable-priority-scheduling"),
            ],
            name="emu",
        )
        asyncio.run(_ordered(emu.url))
    finally:
        procs.stop_all()


async def _ordered(url: str) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        info = (await client.get("/server_info")).json()
        assert info["enable_priority_scheduling"] is True
        await client.post("/emulator/gate", json={"hold_after_chunks": 1})
        body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 4}

        async def send(name: str, priority: int | None, stream: bool = False) -> str:
            extra = {} if priority is None else {"priority": priority}
            response = await client.post(
                "/v1/chat/completions",
                json={**body, **extra, "stream": stream},
                headers={"X-Request-Id": name},
            )
            assert response.status_code == 200, response.text
            return name

        holder = asyncio.ensure_future(send("holder", None, stream=True))
        while (await client.get("/v1/loads")).json()["loads"][0]["num_running_reqs"] < 1:
            await asyncio.sleep(0.01)
        queued = []
        for name, priority in (("low", 0), ("none", None), ("high", 2)):
            queued.append(asyncio.ensure_future(send(name, priority)))
            while (await client.get("/v1/loads")).json()["loads"][0]["num_waiting_reqs"] < len(
                queued
            ):
                await asyncio.sleep(0.01)
        await client.post("/emulator/gate", json={"release": True})
        await asyncio.gather(holder, *queued)
        records = (await client.get("/emulator/stats")).json()["requests"]
        started = {r["request_id"]: r for r in records}
        order = sorted(("low", "none", "high"), key=lambda n: started[n]["started"])
        by_finish = sorted(("low", "none", "high"), key=lambda n: started[n]["finished"])
        assert by_finish == ["high", "low", "none"], (order, by_finish)
        assert [started[n]["priority"] for n in ("low", "none", "high")] == [0, None, 2]
