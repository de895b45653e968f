"""Health checks against a fake SGLang worker on loopback."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from app.config import Settings
from app.upstream.client import UpstreamClient
from app.workers.config import HealthConfig
from app.workers.health import HealthChecker
from app.workers.pool import WorkerPool
from app.workers.worker import WorkerState
from tests.support.gateway import MODEL, FakeWorker


def upstream_client(settings: Settings) -> UpstreamClient:
    """The gateway's worker client, as production builds it."""
    return UpstreamClient(settings)


@pytest.fixture
async def fake() -> AsyncIterator[FakeWorker]:
    worker = FakeWorker(healthy=False)
    await worker.start()
    yield worker
    await worker.stop()


@pytest.fixture
async def checked(fake: FakeWorker) -> AsyncIterator[tuple[HealthChecker, WorkerPool]]:
    settings = Settings(worker_urls=[fake.url])
    client = upstream_client(settings)
    pool = WorkerPool(settings.worker_urls)
    yield HealthChecker(pool, client, HealthConfig(failure_threshold=2)), pool
    await client.aclose()


async def test_a_starting_worker_gets_no_traffic_until_healthy_with_models(
    fake: FakeWorker, checked: tuple[HealthChecker, WorkerPool]
) -> None:
    checker, pool = checked
    (worker,) = pool.workers
    await checker.check_all()
    assert worker.state is WorkerState.STARTING and not pool.available(MODEL)
    fake.healthy, fake.models = True, False
    await checker.check_all()
    assert worker.state is WorkerState.STARTING  # healthy but its models are unknown
    fake.models = True
    await checker.check_all()
    assert worker.state is WorkerState.HEALTHY and pool.available(MODEL) == [worker]


async def test_unhealthy_after_threshold_and_back(
    fake: FakeWorker, checked: tuple[HealthChecker, WorkerPool]
) -> None:
    checker, pool = checked
    (worker,) = pool.workers
    fake.healthy = True
    await checker.check_all()
    assert worker.state is WorkerState.HEALTHY
    fake.healthy = False
    await checker.check_all()
    assert worker.state is WorkerState.HEALTHY  # one failure is not enough
    await checker.check_all()
    assert worker.state is WorkerState.UNHEALTHY
    fake.healthy = True
    await checker.check_all()
    assert worker.state is WorkerState.HEALTHY
