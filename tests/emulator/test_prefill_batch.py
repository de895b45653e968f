"""A worker's prefill compute is shared: waiting prompts are prefilled in batches of at most
--max-prefill-tokens new tokens, one forward pass at a time, as SGLang's scheduler does."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from app.emulator.engine import Timing
from app.emulator.prefill_batch import PrefillBatcher
from tests.emulator.support import record
from tests.support.procs import PYTHON, ProcessManager

EMULATE = [PYTHON, "-m", "app", "emulate", "--port", "{port}", "--speed", "4"]


class _Passes:
    """The forward passes a batcher ran: each one's modelled seconds, in order."""

    def __init__(self) -> None:
        self.seconds: list[float] = []

    async def sleep(self, seconds: float) -> None:
        self.seconds.append(seconds)
        await asyncio.sleep(0)


def test_prompts_waiting_together_share_a_pass_up_to_the_token_budget() -> None:
    timing = Timing(prefill_base_s=0.03, prefill_per_token_s=0.00005)
    passes = _Passes()
    batcher = PrefillBatcher(timing, max_tokens=1000, sleep=passes.sleep)

    async def run() -> list[int]:
        finished: list[int] = []

        async def one(i: int, tokens: int) -> None:
            await batcher.prefill(tokens)
            finished.append(i)

        # Eight short prompts fit one pass; a long one goes alone; two more share the last.
        sizes = [100] * 8 + [5000, 300, 300]
        await asyncio.gather(*(one(i, n) for i, n in enumerate(sizes)))
        return finished

    finished = asyncio.run(run())
    assert passes.seconds == [
        pytest.approx(timing.prefill_s(800)),
        pytest.approx(timing.prefill_s(5000)),
        pytest.approx(timing.prefill_s(600)),
    ]
    assert finished == list(range(11))  # first come, first prefilled
    assert batcher.waiting_tokens == 0


def test_a_prompt_whose_client_left_while_it_waited_costs_no_pass() -> None:
    passes = _Passes()
    batcher = PrefillBatcher(Timing(), max_tokens=100, sleep=passes.sleep)

    async def run() -> None:
        first = asyncio.create_task(batcher.prefill(100))
        gone = asyncio.create_task(batcher.prefill(100))
        await asyncio.sleep(0)
        gone.cancel()
        await first

    asyncio.run(run())
    assert passes.seconds == [pytest.approx(Timing().prefill_s(100))]


def test_long_prompts_sent_together_are_prefilled_one_after_another(
    procs: ProcessManager,
) -> None:
    emu = procs.start(
        [PYTHON, "-m", "app", "emulate", "--port", "{port}", "--speed", "4", "--seed", "5"],
        name="emu-prefill",
    )
    words = " ".join(f"w{i}" for i in range(20000))  # ~30k tokens, each prompt its own

    def body(i: int) -> dict[str, object]:
        return {
            "model": "moonshotai/Kimi-K2.5",
            "messages": [{"role": "user", "content": f"{i} {words}"}],
            "max_tokens": 1,
            "rid": f"long-{i}",
        }

    async def together() -> float:
        async with httpx.AsyncClient(base_url=emu.url, timeout=60) as client:
            start = time.monotonic()
            answers = await asyncio.gather(
                *(client.post("/v1/chat/completions", json=body(i)) for i in range(4))
            )
            assert all(a.status_code == 200 for a in answers)
            return time.monotonic() - start

    elapsed = asyncio.run(together())
    with httpx.Client(base_url=emu.url, timeout=10) as client:
        own = [record(client, f"long-{i}")["prefill_s"] for i in range(4)]
    # Each prompt is over the pass budget, so the four passes ran one after another: the last
    # answer came after all four prefills, not after the longest one.
    assert elapsed >= 0.95 * sum(own)
    assert sum(own) > 2.5 * max(own)


def test_a_prompt_is_matched_against_the_cache_when_its_batch_is_formed(
    procs: ProcessManager,
) -> None:
    """Sessions that arrive together behind the one carrying their shared system prompt find it
    cached: SGLang matches a waiting request as it takes it into a batch, not on arrival."""
    emu = procs.start(
        [PYTHON, "-m", "app", "emulate", "--port", "{port}", "--speed", "4", "--seed", "6"],
        name="emu-shared",
    )
    system = "You are a coding agent. " + " ".join(f"rule{i}" for i in range(8000))

    def body(i: int) -> dict[str, object]:
        return {
            "model": "moonshotai/Kimi-K2.5",
            "messages": [
                {"role": "system", "content": system},
                {"role": "user", "content": f"task {i}: " + "edit the module " * 50},
            ],
            "max_tokens": 1,
            "rid": f"shared-{i}",
        }

    async def together() -> None:
        async with httpx.AsyncClient(base_url=emu.url, timeout=60) as client:
            answers = await asyncio.gather(
                *(client.post("/v1/chat/completions", json=body(i)) for i in range(6))
            )
            assert all(a.status_code == 200 for a in answers)

    asyncio.run(together())
    with httpx.Client(base_url=emu.url, timeout=10) as client:
        cached = sorted(record(client, f"shared-{i}")["cached_tokens"] for i in range(6))
    # The first prefill of the shared prompt is a miss; the ones behind it waited for that pass
    # and found the system prompt cached (each prompt is over half the pass budget, so each
    # went in a pass of its own).
    assert cached[0] == 0
    assert all(c > 10_000 for c in cached[1:])


def test_prompts_still_waiting_hold_no_kv_and_evict_nothing(procs: ProcessManager) -> None:
    """A 40k-token pool holds a cached 12k-token prefix and what runs; five 4k-token prompts
    queued at once hold no KV until their batch runs, so they do not push the prefix out."""
    emu = procs.start(
        [*EMULATE, "--seed", "7", "--max-total-tokens", "40000"],
        name="emu-waiting",
    )
    prefix = "Shared context. " + " ".join(f"fact{i}" for i in range(7000))

    def body(rid: str, text: str) -> dict[str, object]:
        return {
            "model": "moonshotai/Kimi-K2.5",
            "messages": [{"role": "user", "content": text}],
            "max_tokens": 1,
            "rid": rid,
        }

    with httpx.Client(base_url=emu.url, timeout=60) as client:
        assert client.post("/v1/chat/completions", json=body("first", prefix)).status_code == 200

    async def burst() -> None:
        others = [body(f"other-{i}", f"{i} " + "unrelated words " * 1000) for i in range(5)]
        again = body("again", prefix + " and one more question")
        async with httpx.AsyncClient(base_url=emu.url, timeout=60) as client:
            sent = [
                asyncio.create_task(client.post("/v1/chat/completions", json=b)) for b in others
            ]
            await asyncio.sleep(0.05)  # queued behind them, while their first pass runs
            sent.append(asyncio.create_task(client.post("/v1/chat/completions", json=again)))
            answers = await asyncio.gather(*sent)
            assert all(a.status_code == 200 for a in answers)

    asyncio.run(burst())
    with httpx.Client(base_url=emu.url, timeout=10) as client:
        assert record(client, "again")["cached_tokens"] > 10_000


def test_prompts_waiting_for_their_prefill_are_reported_waiting(procs: ProcessManager) -> None:
    """As SGLang reports them: a request is running once it decodes; queued for its prefill
    pass, it is waiting, with its new tokens in num_waiting_uncached_tokens."""
    emu = procs.start([*EMULATE[:-1], "1", "--seed", "8"], name="emu-loads")
    words = " ".join(f"v{i}" for i in range(20000))

    async def run() -> dict[str, int]:
        async with httpx.AsyncClient(base_url=emu.url, timeout=60) as client:
            sent = [
                asyncio.create_task(
                    client.post(
                        "/v1/chat/completions",
                        json={
                            "model": "moonshotai/Kimi-K2.5",
                            "messages": [{"role": "user", "content": f"{i} {words}"}],
                            "max_tokens": 1,
                        },
                    )
                )
                for i in range(3)
            ]
            await asyncio.sleep(0.3)  # the first pass (~1.5 s at --speed 1) is running
            loads = (await client.get("/v1/loads")).json()["loads"][0]
            await asyncio.gather(*sent)
            return dict(loads)

    loads = asyncio.run(run())
    assert loads["num_running_reqs"] == 0
    assert loads["num_waiting_reqs"] == 3
    assert loads["num_waiting_uncached_tokens"] > 50_000  # the two not in the running pass
