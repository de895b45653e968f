"""A real redis-server for the shared per-key limits (installed, or fetched into .tools/: see
``tests.support.tools``)."""

from __future__ import annotations

import pytest

from loadtest.processes import start_redis
from tests.support.gateway import pytest_asyncio_loop_factories  # the harness on uvloop
from tests.support.procs import ProcessManager
from tests.support.tools import require_tool


@pytest.fixture
def redis_url(procs: ProcessManager) -> str:
    return start_redis(procs, require_tool("redis-server"))


__all__ = ["pytest_asyncio_loop_factories", "redis_url"]
