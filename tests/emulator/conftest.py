from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.procs import PYTHON, ManagedProcess, ProcessManager


@pytest.fixture(scope="module")
def emu_module(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ManagedProcess]:
    """One emulator process per test module (speed 50, so steps take ~1 ms)."""
    manager = ProcessManager(Path(tmp_path_factory.mktemp("emu")))
    try:
        yield manager.start(
            [PYTHON, "-m", "app", "emulate", "--port", "{port}", "--speed", "50", "--seed", "7"],
            name="emu",
        )
    finally:
        manager.stop_all()


@pytest.fixture
def emu(emu_module: ManagedProcess) -> Iterator[ManagedProcess]:
    """The module's emulator, with faults, gate and stats reset after each test."""
    yield emu_module
    if emu_module.alive():
        with httpx.Client(base_url=emu_module.url, timeout=5) as client:
            client.post("/emulator/gate", json={"release": True})
            client.post("/emulator/faults", json={"clear": True})
            client.delete("/emulator/stats")
