from tests.support.gateway import pytest_asyncio_loop_factories

__all__ = ["pytest_asyncio_loop_factories"]  # the harness's tests run on uvloop, as the gateway
