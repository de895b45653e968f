"""A real redis-server for the shared quotas (the per-key limits' fixture: installed, or fetched
into .tools/, see ``tests.support.tools``), and the harness's event loop."""

from __future__ import annotations

from tests.security.conftest import pytest_asyncio_loop_factories, redis_url

__all__ = ["pytest_asyncio_loop_factories", "redis_url"]
