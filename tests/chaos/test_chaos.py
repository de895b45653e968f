"""The short chaos run (``make chaos`` runs it for 5 minutes): 3 emulated workers with stats files,
64 concurrent streams, one worker SIGKILLed every 10 s and restarted, for 30 s. Streams cut by a
kill are continued on another worker (``app.proxy.continuation``): every request ends complete, each
stream exactly the one a worker produces uninterrupted (text, text chunks, finish_reason)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx

from loadtest.chaos import PROMPTS, ChaosConfig, one_request, request_body, run_chaos, start_stack
from tests.support.procs import ProcessManager


async def test_every_request_is_accounted_for_while_workers_die(
    procs: ProcessManager, tmp_path: Path
) -> None:
    config = ChaosConfig(duration_s=30.0, warmup_s=2.0)
    report = await run_chaos(procs, config, tmp_path)
    summary = report.summary()
    print(summary)
    assert report.kills >= 2, summary
    assert report.requests > 100, summary
    assert report.unlogged == 0, summary
    assert report.violations == [], summary
    # Every request ended one of the two allowed ways.
    assert report.ok + report.inband_errors == report.requests, summary
    # Streams cut by a kill went on on another worker (one is always up): none ended in error.
    assert report.continued > 0, summary
    assert report.inband_errors == 0, summary
    # Every complete stream was compared with the worker's own, and none differed (violations).
    assert report.compared == report.ok, summary


async def test_with_every_worker_killed_each_stream_ends_with_the_in_band_error(
    procs: ProcessManager, tmp_path: Path
) -> None:
    """All three workers SIGKILLed while 12 long streams run: no worker is left to continue
    them, so each ends as before continuations: the text so far, an in-band error, [DONE]."""
    config = ChaosConfig(speed=1.0)
    gw, emus = start_stack(procs, config, tmp_path)
    body = request_body(config, PROMPTS[0], 4000)
    async with httpx.AsyncClient(timeout=60, trust_env=False) as client:
        begun = [asyncio.Event() for _ in range(12)]
        runs = [
            asyncio.ensure_future(one_request(client, gw, f"dead-{n}", body, begun[n]))
            for n in range(12)
        ]
        # Every stream has begun (thousands of tokens to go): waited for, not slept on.
        async with asyncio.timeout(60):
            await asyncio.gather(*(event.wait() for event in begun))
        assert not any(run.done() for run in runs)
        for emu in emus:
            await asyncio.to_thread(emu.kill)
        results = await asyncio.gather(*runs)
    for out in results:
        assert out.kind == "inband_error", out
        assert out.detail == "stream_interrupted", out
        assert out.events > 2, out  # the text relayed before the kill, then the error
