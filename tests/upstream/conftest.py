from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping

import pytest
import uvloop


def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> Mapping[str, Callable[[], asyncio.AbstractEventLoop]]:
    """The upstream clients' tests run on asyncio's loop and on uvloop (the gateway's loop,
    whose transports are a separate implementation)."""
    return {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}
