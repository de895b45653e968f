from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.procs import ProcessManager
from tests.support.tools import require_tool

# Tests that start processes (gateway, emulators, Prometheus, Redis, the CLI) are marked
# ``processes``; ``make test-fast`` runs the rest (``-m "not processes"``). Marked here: whole
# directories/files of such tests, and every test using a fixture that starts one. A test that
# runs a subprocess by itself carries ``@pytest.mark.processes``.
PROCESS_PATHS = (
    "chaos/",
    "deploy/",
    "e2e/",
    "security/",
    "loadtest/test_smoke.py",
    "metrics/test_live.py",
    "metrics/test_processes.py",
)
PROCESS_FIXTURES = frozenset({"procs", "emu_module", "stack", "live"})
TESTS = Path(__file__).parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        path = Path(str(item.fspath))
        rel = path.relative_to(TESTS).as_posix() if TESTS in path.parents else ""
        fixtures = set(getattr(item, "fixturenames", ()))
        if rel.startswith(PROCESS_PATHS) or fixtures & PROCESS_FIXTURES:
            item.add_marker(pytest.mark.processes)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):  # type: ignore[no-untyped-def]
    report = yield
    setattr(item, f"rep_{report.when}", report)
    return report


@pytest.fixture(scope="session")
def promtool() -> str:
    """promtool's path; the test is skipped when it is missing (fails under
    DFLASH_REQUIRE_TOOLS=1, as in CI)."""
    return require_tool("promtool")


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
