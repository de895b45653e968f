"""The embedded default: emulated SGLang workers started as child processes of ``serve``.

Each child is ``python -m app emulate --port P --speed S --model M`` on 127.0.0.1, on
``embedded.base_port + i`` (or a free port when that one is taken or ``base_port`` is 0). The
children die with the gateway: ``stop()`` terminates them, and on Linux they also get SIGTERM
from the kernel if the gateway itself is killed (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx

from app.server.config import EmbeddedConfig

log = logging.getLogger(__name__)
HOST = "127.0.0.1"


class EmbeddedStartError(RuntimeError):
    pass


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((HOST, port))
        except OSError:
            return False
    return True


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


def _die_with_parent() -> None:  # runs in the child between fork and exec
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


@dataclass
class _Child:
    url: str
    popen: subprocess.Popen[bytes]


class EmbeddedWorkers:
    def __init__(
        self, config: EmbeddedConfig, *, python: str = sys.executable, pd: bool = False
    ) -> None:
        self._config = config
        self._python = python
        self._children: list[_Child] = []
        # PD disaggregation: one emulated prefill worker (with its bootstrap port) and one
        # emulated decode worker, instead of ``config.workers`` whole ones.
        self._pd = pd
        self.bootstrap_port: int | None = None

    @property
    def urls(self) -> list[str]:
        return [child.url for child in self._children]

    def _ports(self) -> Iterator[int]:
        taken: set[int] = set()
        for i in range(2 if self._pd else self._config.workers):
            port = self._config.base_port + i if self._config.base_port else 0
            if not port or not _port_free(port):
                if port:
                    log.warning("port %d is taken; the emulated worker uses a free port", port)
                port = _free_port()
                while port in taken:
                    port = _free_port()
            taken.add(port)
            yield port

    def start(self, timeout: float = 60.0) -> list[str]:
        """Start every worker and wait until each answers ``/health`` with 200."""
        for i, port in enumerate(self._ports()):
            argv = [
                self._python, "-m", "app", "emulate",
                "--host", HOST,
                "--port", str(port),
                "--speed", repr(self._config.speed),
                "--model", self._config.model,
            ]  # fmt: skip
            if self._pd and i == 0:
                self.bootstrap_port = _free_port()
                argv += [
                    "--disaggregation-mode", "prefill",
                    "--disaggregation-bootstrap-port", str(self.bootstrap_port),
                ]  # fmt: skip
            elif self._pd:
                argv += ["--disaggregation-mode", "decode"]
            popen = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                # Out of the terminal's process group: Ctrl-C reaches the gateway only, which
                # then stops its workers cleanly (no KeyboardInterrupt traceback per worker).
                start_new_session=True,
                preexec_fn=_die_with_parent if sys.platform == "linux" else None,
            )
            self._children.append(_Child(f"http://{HOST}:{port}", popen))
        self._wait_healthy(timeout)
        return self.urls

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        pending = list(self._children)
        with httpx.Client(timeout=2.0, trust_env=False) as client:
            while pending:
                for child in list(pending):
                    if child.popen.poll() is not None:
                        raise EmbeddedStartError(
                            f"emulated worker {child.url} exited with {child.popen.returncode}"
                        )
                    with contextlib.suppress(httpx.HTTPError):
                        if client.get(child.url + "/health").status_code == 200:
                            pending.remove(child)
                if pending and time.monotonic() > deadline:
                    raise EmbeddedStartError(
                        f"emulated workers not healthy after {timeout:g}s: "
                        + ", ".join(c.url for c in pending)
                    )
                if pending:
                    time.sleep(0.1)

    def stop(self, timeout: float = 5.0) -> None:
        for child in self._children:
            if child.popen.poll() is None:
                child.popen.terminate()
        deadline = time.monotonic() + timeout
        for child in self._children:
            try:
                child.popen.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("emulated worker %s still running; killing it", child.url)
                child.popen.kill()
                child.popen.wait()
        self._children.clear()

    def __enter__(self) -> EmbeddedWorkers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
