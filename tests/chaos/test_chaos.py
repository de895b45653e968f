"""The short chaos run (``make chaos`` runs it for 5 minutes): 3 emulated workers with stats files,
64 concurrent streams, one worker SIGKILLed every 10 s and restarted, for 30 s. Streams cut by a
kill are continued on another worker (``app.proxy.resume``): every request ends complete, each
stream exactly the one a worker produces uninterrupted (text, text chunks, finish_reason)."""

from __future__ import annotations

from pathlib import Path

from loadtest.chaos import ChaosConfig, run_chaos
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
