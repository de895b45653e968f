"""Background tasks under supervision (``app.background``), and a fleet whose worker reports
hostile ``/v1/loads`` figures: health checking and load polling go on for everyone."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

from app.background import Backoff, supervise
from app.config import Settings
from app.metrics import Metrics
from app.upstream.client import UpstreamClient
from app.workers.config import HealthConfig
from app.workers.health import HealthChecker
from app.workers.pool import WorkerPool
from app.workers.worker import Worker, WorkerState
from tests.support.gateway import MODEL, FakeWorker, GatewayHarness, wait_for

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}


def restarts(metrics: Metrics, task: str) -> float:
    value = metrics.registry.get_sample_value(
        "dflash_gateway_background_task_restarts_total", {"task": task}
    )
    assert value is not None  # pre-initialised: the series exists from start-up
    return value


async def test_a_crashing_task_is_logged_counted_and_restarted_with_capped_backoff(
    caplog: pytest.LogCaptureFixture,
) -> None:
    metrics = Metrics()
    now = [0.0]
    waits: list[float] = []
    runs = 0

    async def sleep(seconds: float) -> None:
        waits.append(seconds)
        now[0] += seconds

    async def crashes() -> None:
        nonlocal runs
        runs += 1
        if runs == 8:  # a long run before this crash: the backoff starts afresh
            now[0] += 60.0
        if runs == 10:
            await asyncio.Event().wait()  # healthy at last: runs until cancelled
        raise OverflowError("cannot convert float infinity to integer")

    backoff = Backoff(first_s=0.5, max_s=4.0, reset_after_s=60.0)
    task = asyncio.create_task(
        supervise(
            "loads",
            crashes,
            metrics.record_task_restart,
            backoff=backoff,
            clock=lambda: now[0],
            sleep=sleep,
        )
    )
    with caplog.at_level(logging.ERROR, logger="app.background"):
        await wait_for(lambda: runs == 10)
    assert not task.done()
    assert waits == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0, 4.0, 0.5, 1.0]
    assert restarts(metrics, "loads") == 9
    assert restarts(metrics, "health") == 0
    crashed = [r for r in caplog.records if "background task loads crashed" in r.getMessage()]
    assert len(crashed) == 9
    assert crashed[0].exc_info is not None and crashed[0].exc_info[0] is OverflowError
    task.cancel()  # the gateway stopping ends it
    with pytest.raises(asyncio.CancelledError):
        await task
    assert restarts(metrics, "loads") == 9


class _FailingOnce:
    """The gateway's worker client, whose first ``/v1/loads`` call raises what no handler
    expects (a bug's exception, not an ``UpstreamError``)."""

    def __init__(self, client: UpstreamClient) -> None:
        self._client = client
        self.failed = False

    async def get(self, worker: Worker, path: str, timeout: float) -> Any:
        if path.startswith("/v1/loads") and not self.failed:
            self.failed = True
            raise RuntimeError("a bug in load parsing")
        return await self._client.get(worker, path, timeout)


async def test_health_checking_survives_a_crash_during_readmission() -> None:
    """The crash comes while the worker is being admitted (its capacity read first): the health
    task is restarted and admits it, instead of leaving it out of the fleet for good."""
    fake = FakeWorker()
    await fake.start()
    settings = Settings(worker_urls=[fake.url])
    client = UpstreamClient(settings)
    try:
        pool = WorkerPool(settings.worker_urls)
        flaky = _FailingOnce(client)
        checker = HealthChecker(pool, flaky, HealthConfig(interval_s=0.05))  # type: ignore[arg-type]
        metrics = Metrics()
        backoff = Backoff(first_s=0.01, max_s=0.01)
        task = asyncio.create_task(
            supervise("health", checker.run, metrics.record_task_restart, backoff=backoff)
        )
        try:
            await wait_for(lambda: pool.workers[0].state is WorkerState.HEALTHY)
        finally:
            task.cancel()
        assert flaky.failed
        assert restarts(metrics, "health") == 1
    finally:
        await client.aclose()
        await fake.stop()


HOSTILE_RANK = {
    "dp_rank": 0,
    "num_running_reqs": 1.7e308,
    "num_waiting_reqs": -1e18,
    "token_usage": 1e300,
    "gen_throughput": -1e300,
    "max_running_requests": 1e300,
}


@pytest.mark.parametrize("running", [1.7e308, 1e300, -1e18])
async def test_a_worker_reporting_hostile_loads_leaves_the_fleet_healthy(running: float) -> None:
    hostile = FakeWorker(loads={"loads": [{**HOSTILE_RANK, "num_running_reqs": running}] * 2})
    async with GatewayHarness(
        [hostile, FakeWorker()], health={"interval_s": 0.05, "loads_interval_s": 0.05}
    ) as gw:
        pool = gw.gateway.pool
        seen = hostile.loads_served
        await wait_for(lambda: hostile.loads_served >= seen + 5)  # polled again and again
        assert [w.state for w in pool.workers] == [WorkerState.HEALTHY] * 2
        assert (await gw.request("GET", "/readyz")).status == 200
        for _ in range(4):  # both workers serve
            assert (await gw.post("/v1/chat/completions", CHAT)).status == 200
        view = (await gw.request("GET", "/workers")).json()
        assert 0.0 <= view["saturation"] <= 1.0
        hostile_view = next(w for w in view["workers"] if w["name"] == hostile.name)
        load = hostile_view["load"]
        assert (load["running"], load["waiting"], load["token_usage"]) == (0, 0, 0.0)
        metrics = gw.gateway.metrics
        for task in ("health", "loads"):
            assert restarts(metrics, task) == 0  # nothing crashed
        exposition = metrics.render().decode()
        assert "dflash_gateway_fleet_saturation 0.0" in exposition
