"""Real processes on loopback: two emulated workers and a gateway in front of them, shared by the
module's tests (each test starts from cleared faults and an open gate)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from tests.support.procs import PYTHON, ManagedProcess, ProcessManager, managed_processes

FAST_HEALTH = {"DFLASH_GATEWAY_HEALTH__INTERVAL_S": "0.3", "DFLASH_GATEWAY_LOG_LEVEL": "info"}


EMULATE = [PYTHON, "-m", "app", "emulate", "--port", "{port}", "--speed", "20"]


def emulator(procs: ProcessManager, name: str, *args: str) -> ManagedProcess:
    return procs.start([*EMULATE, *args], name=name, ready_path="/health", ready_status=200)


def gateway(
    procs: ProcessManager,
    workers: list[ManagedProcess] | list[str],
    *,
    env: dict[str, str] | None = None,
    ready: bool = True,
) -> ManagedProcess:
    argv = [PYTHON, "-m", "app", "serve", "--port", "{port}"]
    for worker in workers:
        argv += ["--worker-url", worker if isinstance(worker, str) else worker.url]
    return procs.start(
        argv,
        name="gateway",
        ready_path="/readyz" if ready else "/livez",
        ready_status=200,
        env={**FAST_HEALTH, **(env or {})},
    )


def make_run(procs: ProcessManager, env: dict[str, str] | None = None) -> ManagedProcess:
    """``make run``: ``serve`` with no workers and no keys (the embedded default: emulated
    workers on free ports)."""
    defaults = {"DFLASH_GATEWAY_EMBEDDED__BASE_PORT": "0", "DFLASH_GATEWAY_EMBEDDED__SPEED": "20"}
    return procs.start(
        [PYTHON, "-m", "app", "serve", "--port", "{port}"],
        name="serve",
        ready_path="/readyz",
        ready_status=200,
        timeout=60,
        env={**defaults, **(env or {})},
    )


def poll(predicate: Callable[[], Any], timeout: float = 5.0, interval: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout}s")
        time.sleep(interval)


@dataclass
class Stack:
    gw: ManagedProcess
    emus: list[ManagedProcess]

    def control(self, emu: ManagedProcess, path: str, body: dict[str, Any]) -> Any:
        response = httpx.post(emu.url + path, json=body, timeout=5)
        response.raise_for_status()
        return response.json()

    def stats(self, emu: ManagedProcess) -> dict[str, Any]:
        return httpx.get(emu.url + "/emulator/stats", timeout=5).json()  # type: ignore[no-any-return]

    def in_flight(self) -> dict[str, int]:
        table = httpx.get(self.gw.url + "/workers", timeout=5).json()["workers"]
        return {w["url"]: w["in_flight"] for w in table}

    def reset(self) -> None:
        for emu in self.emus:
            self.control(emu, "/emulator/faults", {"clear": True})
            self.control(emu, "/emulator/gate", {"release": True})


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with managed_processes(tmp_path_factory, "e2e") as manager:
        emus = [
            emulator(manager, "emu-a", "--seed", "1"),
            emulator(manager, "emu-b", "--seed", "1"),
        ]
        # least_inflight: these tests name the worker a lone request goes to (ties by name).
        yield Stack(gateway(manager, emus, env={"DFLASH_GATEWAY_POLICY": "least_inflight"}), emus)


@pytest.fixture
def fresh(stack: Stack) -> Iterator[Stack]:
    stack.reset()
    yield stack
    stack.reset()
