"""Real processes for integration tests; the implementation is shared with the benchmarks."""

from loadtest.processes import (
    PYTHON,
    ManagedProcess,
    ProcessManager,
    ProcessStartError,
    free_port,
)

__all__ = ["PYTHON", "ManagedProcess", "ProcessManager", "ProcessStartError", "free_port"]
