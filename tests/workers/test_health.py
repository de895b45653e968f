from __future__ import annotations

import httpx

from app.config import HealthConfig, Settings
from app.upstream.client import UpstreamClient
from app.workers.health import HealthChecker
from app.workers.pool import WorkerPool
from app.workers.worker import WorkerState

MODEL = "moonshotai/Kimi-K2.5"


class FakeWorkers:
    def __init__(self) -> None:
        self.health = 503
        self.models_ok = True

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/health":
            return httpx.Response(self.health)
        if request.url.path == "/v1/models" and self.models_ok:
            return httpx.Response(200, json={"object": "list", "data": [{"id": MODEL}]})
        return httpx.Response(404)


def make(fake: FakeWorkers) -> tuple[HealthChecker, WorkerPool]:
    settings = Settings(worker_urls=["http://w:1"])
    client = UpstreamClient(settings, httpx.MockTransport(fake))
    pool = WorkerPool(settings.worker_urls)
    return HealthChecker(pool, client, HealthConfig(failure_threshold=2)), pool


async def test_a_starting_worker_gets_no_traffic_until_healthy_with_models() -> None:
    fake = FakeWorkers()
    checker, pool = make(fake)
    (worker,) = pool.workers
    await checker.check_all()
    assert worker.state is WorkerState.STARTING and not pool.available(MODEL)
    fake.health, fake.models_ok = 200, False
    await checker.check_all()
    assert worker.state is WorkerState.STARTING  # healthy but its models are unknown
    fake.models_ok = True
    await checker.check_all()
    assert worker.state is WorkerState.HEALTHY and pool.available(MODEL) == [worker]


async def test_unhealthy_after_threshold_and_back() -> None:
    fake = FakeWorkers()
    fake.health = 200
    checker, pool = make(fake)
    (worker,) = pool.workers
    await checker.check_all()
    assert worker.state is WorkerState.HEALTHY
    fake.health = 503
    await checker.check_all()
    assert worker.state is WorkerState.HEALTHY  # one failure is not enough
    await checker.check_all()
    assert worker.state is WorkerState.UNHEALTHY
    fake.health = 200
    await checker.check_all()
    assert worker.state is WorkerState.HEALTHY
