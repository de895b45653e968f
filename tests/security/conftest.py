"""A real redis-server for the shared per-key limits (installed, or fetched into .tools/: see
``tests.support.tools``)."""

from __future__ import annotations

import socket
import time

import pytest

from tests.support.gateway import pytest_asyncio_loop_factories  # the harness on uvloop
from tests.support.procs import ProcessManager
from tests.support.tools import require_tool


@pytest.fixture
def redis_url(procs: ProcessManager) -> str:
    server = require_tool("redis-server")
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
