"""``serve --processes N``: N gateway processes on one port, forked and supervised by the parent.

Each process runs its own event loop, worker pool, health checks and admission share, and
accepts on its own ``SO_REUSEPORT`` socket bound to the same address (the kernel spreads new
connections evenly; every socket is bound by the parent before forking, so the port is held
from start to end and a restarted process takes over its predecessor's socket and backlog).
The embedded default's emulated workers are started once, by the parent, before the fork.

Metrics: ``__main__`` sets ``PROMETHEUS_MULTIPROC_DIR`` (a fresh private directory) before
prometheus_client is imported; every process writes its own files there and ``/metrics`` in any
of them merges all (``app.metrics``). The parent marks a dead process's live gauges dead.

Signals: the processes live in their own process groups, so a terminal's Ctrl-C or a
``kill`` of the parent's group reaches the parent only, which passes the signal it got to each:
SIGTERM starts the graceful drain of ``app.server.DrainingServer`` (the accept window, then the
in-flight streams), Ctrl-C (SIGINT) stops them at once as it stops a single process (in-flight
streams still get up to ``drain_s``); each further signal is passed on as a Ctrl-C (during a
drain the first ends the accept window, the next cuts the streams). SIGINT/SIGTERM are
held back while a process is forked, so each one forked is known and signalled.
If the parent dies, the kernel sends them SIGTERM (``PR_SET_PDEATHSIG``). A process that exits
on its own is started again, after a back-off that grows while it keeps dying young.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from prometheus_client import multiprocess

log = logging.getLogger(__name__)
_POLL_S = 0.2
_YOUNG_S = 10.0  # a process that dies younger than this backs off before its restart
_MAX_BACKOFF_S = 30.0
_STOP_SIGNALS = frozenset({signal.SIGINT, signal.SIGTERM})


@dataclass(slots=True)
class _Process:
    index: int
    pid: int
    started: float
    failures: int = 0  # consecutive young deaths


def _die_with_parent(parent: int) -> None:
    """In a forked process: SIGTERM when the parent dies; own process group."""
    with contextlib.suppress(OSError):
        os.setpgid(0, 0)
    if sys.platform == "linux":
        with contextlib.suppress(Exception):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the parent died before the line above
        os._exit(0)


class ProcessGroup:
    """Forks ``count`` processes running ``target(index)`` and keeps them running until stopped."""

    def __init__(
        self,
        count: int,
        target: Callable[[int], None],
        *,
        stop_timeout_s: float,
        metrics_dir: Path | None = None,
    ) -> None:
        self._count = count
        self._target = target
        self._stop_timeout_s = stop_timeout_s
        self._metrics_dir = metrics_dir
        self._processes: dict[int, _Process] = {}
        # SIGINT/SIGTERM handlers as they were before ``run``: each gateway process starts with
        # them (the parent's own only note a signal).
        self._handlers: dict[int, Any] = {}

    def _fork(self, index: int, failures: int = 0) -> None:
        parent = os.getpid()
        # A stop signal arriving now is taken once the new process is in ``_processes``; the new
        # process gets the handlers the parent had before ``run`` before it takes any signal.
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
        try:
            pid = os.fork()
            if pid == 0:
                self._child(index, parent, mask)
            self._processes[pid] = _Process(index, pid, time.monotonic(), failures)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)

    def _child(self, index: int, parent: int, mask: set[int | signal.Signals]) -> NoReturn:
        """The gateway process: runs ``target(index)`` and exits, whatever happens (it never
        returns into the parent's code, not even on a signal during its last flush)."""
        code = 1
        try:
            try:
                for sig, handler in self._handlers.items():
                    signal.signal(sig, handler)
                _die_with_parent(parent)
                signal.pthread_sigmask(signal.SIG_SETMASK, mask)
                self._target(index)
                code = 0
            except KeyboardInterrupt:
                code = 0
            except BaseException:
                log.exception("gateway process %d failed", index)
            with contextlib.suppress(BaseException):
                sys.stdout.flush()
                sys.stderr.flush()
        finally:
            os._exit(code)

    def run(self) -> None:
        """Start the processes and supervise them until Ctrl-C or SIGTERM ends this one; then
        pass that signal on (``stop``) and return once they are gone. The parent's handlers only
        note a signal (the loops below look every ``_POLL_S``): no exception ever interrupts it
        half-way through a fork or a round of signals."""
        received: list[int] = []

        def note(signum: int, frame: object) -> None:
            received.append(signum)

        self._handlers = {sig: signal.signal(sig, note) for sig in _STOP_SIGNALS}
        try:
            for index in range(self._count):
                if received:
                    break
                self._fork(index)
            self._supervise(received)
            self.stop(received)
        finally:
            for sig, handler in self._handlers.items():
                signal.signal(sig, handler)

    def _supervise(self, received: list[int]) -> None:
        restarts: list[tuple[float, int, int]] = []  # (when, index, failures)
        while not received:
            for pid, proc in list(self._processes.items()):
                done, status = os.waitpid(pid, os.WNOHANG)
                if not done:
                    continue
                del self._processes[pid]
                self._mark_dead(pid)
                young = time.monotonic() - proc.started < _YOUNG_S
                failures = proc.failures + 1 if young else 0
                delay = min(_MAX_BACKOFF_S, 2.0**failures - 1) if young else 0.0
                log.error(
                    "gateway process %d (pid %d) exited with %s; restarting it in %.0f s",
                    proc.index,
                    pid,
                    _describe(status),
                    delay,
                )
                restarts.append((time.monotonic() + delay, proc.index, failures))
            now = time.monotonic()
            for entry in [r for r in restarts if r[0] <= now]:
                if received:
                    break
                restarts.remove(entry)
                self._fork(entry[1], entry[2])
            time.sleep(_POLL_S)

    def stop(self, received: list[int]) -> None:
        """Pass on the first stop signal in ``received`` to each process (SIGTERM: the graceful
        drain; SIGINT: stop now) and wait up to ``stop_timeout_s``, then SIGKILL. Each further
        signal noted in ``received`` is passed on as SIGINT, as a terminal's Ctrl-C would reach a
        single process: the first one during a drain ends its accept window, the next one cuts
        the in-flight streams."""
        seen = len(received)
        self._signal_all(received[0])
        deadline = time.monotonic() + self._stop_timeout_s
        while self._processes:
            self._reap()
            if len(received) > seen:
                seen = len(received)
                self._signal_all(signal.SIGINT)
            if self._processes and time.monotonic() > deadline:
                log.warning("gateway processes still running; killing them")
                self._signal_all(signal.SIGKILL)
                deadline = float("inf")
            time.sleep(_POLL_S / 4)

    def _reap(self) -> None:
        for pid in list(self._processes):
            try:
                done, _ = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                done = pid
            if done:
                del self._processes[pid]
                self._mark_dead(pid)

    def _signal_all(self, sig: int) -> None:
        for pid in self._processes:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)

    def _mark_dead(self, pid: int) -> None:
        if self._metrics_dir is not None:
            multiprocess.mark_process_dead(pid, str(self._metrics_dir))  # type: ignore[no-untyped-call]


def _describe(status: int) -> str:
    if os.WIFSIGNALED(status):
        return f"signal {signal.Signals(os.WTERMSIG(status)).name}"
    return f"code {os.waitstatus_to_exitcode(status)}"
