from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.procs import ProcessManager


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):  # type: ignore[no-untyped-def]
    report = yield
    setattr(item, f"rep_{report.when}", report)
    return report


@pytest.fixture
def procs(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[ProcessManager]:
    """Start real processes on free loopback ports; all are stopped at teardown, and their logs
    are printed when the test failed."""
    manager = ProcessManager(tmp_path)
    try:
        yield manager
    finally:
        manager.stop_all()
        failed = getattr(request.node, "rep_call", None)
        if failed is not None and failed.failed:
            for chunk in manager.dump_logs():
                print(chunk)
