"""In-process units: latency model, scheduler (slots, FIFO queue, queue-full, abort while
waiting), prefix cache, fault updates, profile choice."""

from __future__ import annotations

import asyncio

import pytest

from app.emulator.engine import ActiveRequest, QueueFull, Scheduler, Timing
from app.emulator.faults import FaultError, Faults, Gate
from app.emulator.profiles import PROFILE_TAU, SEED_OUTPUT_TPS, step_time_factors
from app.emulator.requests import GenRequest
from app.emulator.session import pick_profile


def _req(rid: str) -> ActiveRequest:
    return ActiveRequest(rid=rid, profile="gsm8k", stream=True, started=0.0, started_mono=0.0)


def test_step_latency_grows_with_running_and_scales_with_speed() -> None:
    timing = Timing()
    assert timing.step_s(1) < timing.step_s(32) < timing.step_s(48)
    assert 0.05 < timing.step_s(32) < 0.09  # the seed's Kimi order of magnitude at C=32
    assert Timing(speed=20).step_s(32) == pytest.approx(timing.step_s(32) / 20)
    assert timing.prefill_s(10) < timing.prefill_s(10000)


async def test_scheduler_slots_queue_and_queue_full() -> None:
    scheduler = Scheduler(max_running=1, max_queued=1)
    first, second, third = _req("a"), _req("b"), _req("c")
    assert await scheduler.acquire(first)
    waiting = asyncio.ensure_future(scheduler.acquire(second))
    await asyncio.sleep(0)
    assert scheduler.waiting == 1 and not waiting.done()
    with pytest.raises(QueueFull):
        await scheduler.acquire(third)
    scheduler.release()  # the slot passes to the waiting request
    assert await waiting is True
    assert scheduler.running == 1 and scheduler.waiting == 0
    scheduler.release()
    assert scheduler.running == 0


async def test_abort_while_waiting_and_prefix_match() -> None:
    scheduler = Scheduler(max_running=1, max_queued=None)
    holder, queued, other = _req("abc-1"), _req("abc-2"), _req("xyz")
    for req in (holder, queued, other):
        scheduler.register(req)
    assert await scheduler.acquire(holder)
    waiting = asyncio.ensure_future(scheduler.acquire(queued))
    await asyncio.sleep(0)
    assert scheduler.abort("abc") == 2
    assert await waiting is False
    assert holder.aborted == queued.aborted == "abort" and other.aborted is None
    assert scheduler.abort("") == 0
    assert scheduler.abort("", abort_all=True) == 1
    scheduler.release()
    assert scheduler.running == 0 and scheduler.waiting == 0


def test_fault_updates() -> None:
    faults = Faults()
    faults.update({"fail_status": 503, "fail_ratio": 0.25})
    assert (faults.fail_status, faults.fail_ratio) == (503, 0.25)
    with pytest.raises(FaultError):
        faults.update({"fail_status": 200})
    assert faults.fail_status == 503, "a refused update changes nothing"
    faults.update({"clear": True, "unhealthy": True})
    assert faults.fail_status is None and faults.unhealthy


def test_profile_choice_header_then_flag_then_classifier() -> None:
    req = GenRequest(kind="chat", model="m", prompt="p", last_user="Write a function to add.")
    assert pick_profile("MathGSM", "auto", req) == "mbpp", "unknown header names are ignored"
    assert pick_profile("math500", "gsm8k", req) == "math500"
    assert pick_profile(None, "gsm8k", req) == "gsm8k"
    assert pick_profile(None, "auto", req) == "mbpp"


def test_per_profile_step_time_reproduces_seed_throughput_at_c32() -> None:
    timing = Timing()
    for profile, factor in step_time_factors().items():
        tokens_per_s = 32 * PROFILE_TAU[profile] / timing.step_s(32, factor)
        assert abs(tokens_per_s / SEED_OUTPUT_TPS[profile] - 1) < 0.02, profile


async def test_gate_rehold_keeps_held_streams_releasable() -> None:
    gate = Gate()
    gate.hold(1)
    assert gate.applies(1) and not gate.applies(2)
    held = asyncio.ensure_future(gate.wait())
    await asyncio.sleep(0)
    gate.hold(3)  # changing k while a stream is held must not strand it
    assert gate.held == 1
    gate.release()
    await asyncio.wait_for(held, 5)
    assert gate.held == 0 and not gate.applies(3)
