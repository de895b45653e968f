"""A real redis-server (from Debian; .ci/run installs it) for the shared per-key limits."""

from __future__ import annotations

import shutil
import socket
import time

import pytest

from tests.support.gateway import pytest_asyncio_loop_factories  # the harness on uvloop
from tests.support.procs import ProcessManager


@pytest.fixture
def redis_url(procs: ProcessManager) -> str:
    server = shutil.which("redis-server")
    if server is None:
        pytest.fail("redis-server is not installed (.ci/run installs it from Debian)")
    proc = procs.start(
        [server, "--port", "{port}", "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        name="redis",
        ready_path=None,
    )
    deadline = time.monotonic() + 10
    while True:
        try:
            socket.create_connection(("127.0.0.1", proc.port), timeout=0.5).close()
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    return f"redis://127.0.0.1:{proc.port}/0"


__all__ = ["pytest_asyncio_loop_factories", "redis_url"]
