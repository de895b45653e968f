"""Real processes for tests and benchmarks: start on a free loopback port, wait until ready, capture
logs, always terminate.

    def test_x(procs):
        emu = procs.start(["python", "-m", "app", "emulate", "--port", "{port}"], name="emu")
        httpx.get(emu.url + "/health")

``{port}`` in the command line is replaced by a free port; the process is ready when
``ready_path`` answers with a status below 500 (or ``ready_status`` exactly, when given).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

PYTHON = sys.executable
ADDRESS_IN_USE_MARKERS = ("address already in use", "errno 98")


def free_port() -> int:
    """A port that was free a moment ago (the kernel picks it; the caller binds it soon)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class ProcessStartError(RuntimeError):
    pass


@dataclass
class ManagedProcess:
    name: str
    argv: list[str]
    port: int
    log_path: Path
    env: dict[str, str]
    popen: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        assert self.popen is not None
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def logs(self) -> str:
        try:
            return self.log_path.read_text(encoding="utf-8", errors="replace")
        except FileNotFoundError:
            return ""

    def _spawn(self) -> None:
        log = self.log_path.open("ab")
        try:
            self.popen = subprocess.Popen(
                self.argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.env,
                start_new_session=True,  # its own process group: children die with it
            )
        finally:
            log.close()

    def signal(self, sig: int) -> None:
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pid, sig)

    def kill(self) -> None:
        """SIGKILL the whole process group and reap it (a crash, for fault tests)."""
        if self.popen is None:
            return
        self.signal(signal.SIGKILL)
        self.popen.wait(timeout=10)

    def stop(self, timeout: float = 10.0) -> int | None:
        """SIGINT (Ctrl-C: the gateway stops at once, where SIGTERM would start its drain
        window), then SIGKILL after ``timeout``; returns the exit code."""
        if self.popen is None:
            return None
        if self.alive():
            self.signal(signal.SIGINT)
            try:
                self.popen.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        # Stray children of the group (e.g. emulated workers) must not outlive the test.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)
        return self.popen.returncode

    def wait_ready(self, ready_path: str, timeout: float, ready_status: int | None) -> None:
        deadline = time.monotonic() + timeout
        with httpx.Client(timeout=2.0) as client:
            while time.monotonic() < deadline:
                if not self.alive():
                    raise ProcessStartError(
                        f"{self.name} exited with {self.popen and self.popen.returncode} "
                        f"before it was ready:\n{self.logs()[-4000:]}"
                    )
                try:
                    response = client.get(self.url + ready_path)
                except httpx.TransportError:
                    pass
                else:
                    ok = (
                        response.status_code < 500
                        if ready_status is None
                        else (response.status_code == ready_status)
                    )
                    if ok:
                        return
                time.sleep(0.05)
        raise ProcessStartError(
            f"{self.name} not ready on {self.url}{ready_path} after {timeout}s:\n"
            f"{self.logs()[-4000:]}"
        )


class ProcessManager:
    """Owns every process a test starts; ``stop_all`` runs at teardown whatever happened."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.processes: list[ManagedProcess] = []

    def start(
        self,
        argv: Sequence[str],
        *,
        name: str | None = None,
        ready_path: str | None = "/health",
        ready_status: int | None = None,
        timeout: float = 30.0,
        env: dict[str, str] | None = None,
        port: int | None = None,
    ) -> ManagedProcess:
        name = name or Path(argv[0]).name
        attempts = 1 if port is not None else 3
        for attempt in range(attempts):
            chosen = port if port is not None else free_port()
            proc = ManagedProcess(
                name=name,
                argv=[arg.replace("{port}", str(chosen)) for arg in argv],
                port=chosen,
                log_path=self.log_dir / f"{name}-{len(self.processes)}.log",
                env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
            )
            self.processes.append(proc)
            proc._spawn()
            if ready_path is None:
                return proc
            try:
                proc.wait_ready(ready_path, timeout, ready_status)
                return proc
            except ProcessStartError:
                lost_race = any(m in proc.logs().lower() for m in ADDRESS_IN_USE_MARKERS)
                proc.stop()
                if not lost_race or attempt == attempts - 1:
                    raise
        raise AssertionError("unreachable")

    def restart(
        self, proc: ManagedProcess, *, ready_path: str | None = "/health", timeout: float = 30.0
    ) -> ManagedProcess:
        """Start the same command on the same port again (after ``kill``/``stop``)."""
        proc.stop()
        proc._spawn()
        if ready_path is not None:
            proc.wait_ready(ready_path, timeout, None)
        return proc

    def stop_all(self) -> None:
        for proc in reversed(self.processes):
            proc.stop()

    def dump_logs(self) -> Iterator[str]:
        for proc in self.processes:
            yield f"----- {proc.name} ({' '.join(proc.argv)}) -----\n{proc.logs()[-6000:]}"


def start_redis(procs: ProcessManager, server: str, name: str = "redis") -> str:
    """A throwaway redis-server (``server``: its binary) on a free loopback port, no persistence;
    returns its URL once it accepts connections."""
    proc = procs.start(
        [server, "--port", "{port}", "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        name=name,
        ready_path=None,
    )
    deadline = time.monotonic() + 10
    while True:
        try:
            socket.create_connection(("127.0.0.1", proc.port), timeout=0.5).close()
            return f"redis://127.0.0.1:{proc.port}/0"
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
