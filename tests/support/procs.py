"""Real processes for integration tests; the implementation is shared with the benchmarks."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from loadtest.processes import (
    PYTHON,
    ManagedProcess,
    ProcessManager,
    ProcessStartError,
    free_port,
)

__all__ = [
    "PYTHON",
    "ManagedProcess",
    "ProcessManager",
    "ProcessStartError",
    "children",
    "free_port",
    "managed_processes",
]


def children(pid: int) -> dict[int, str]:
    """``pid``'s child processes: pid -> command line."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if int(stat[stat.rindex(")") + 2 :].split()[1]) == pid:
            found[int(entry.name)] = cmdline
    return found


def serve_processes(procs: ProcessManager, env: dict[str, str], count: int = 2) -> ManagedProcess:
    """``serve --processes count`` with the embedded default (the emulated workers), ready."""
    return procs.start(
        [PYTHON, "-m", "app", "serve", "--port", "{port}", "--processes", str(count)],
        name="gateway",
        ready_path="/readyz",
        ready_status=200,
        env=env,
        timeout=60,
    )


@contextlib.contextmanager
def managed_processes(
    tmp_path_factory: pytest.TempPathFactory, name: str
) -> Iterator[ProcessManager]:
    """A module's processes (logs under a fresh ``name`` directory): every one is stopped on the
    way out, and their logs are printed if setting them up failed."""
    manager = ProcessManager(Path(tmp_path_factory.mktemp(name)))
    try:
        yield manager
    except BaseException:
        for chunk in manager.dump_logs():
            print(chunk)
        raise
    finally:
        manager.stop_all()
