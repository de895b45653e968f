"""The usage log: one JSON line per request, for a billing job that reads files, not a database.

``tenants.usage_log`` names the file. Every request to a completion route (chat, text
completions, Messages, count_tokens) that is attributable to a key gets a line when its answer
ends: the ones the proxy ran and the ones refused at the door (401 aside: with keys configured, a
request without a valid key belongs to no one, and unauthenticated traffic must not be able to
rotate billable lines away). Refused requests carry zero tokens. Fields, in this order::

    time (RFC 3339 UTC, when the answer ended), request_id (the gateway's own, unique),
    client_request_id (the client's X-Request-Id, escaped; null without one), key, priority,
    model, worker, route,
    stream, status, outcome, prompt_tokens, completion_tokens, reasoning_tokens, accept_length,
    ttft_ms, duration_ms, attempts, continuations, continuation_prompt_tokens,
    tokens_estimated, usage_estimated

A continued stream (``app.proxy.continuation``) counts every attempt: its ``prompt_tokens``
include the continuations' prompts (the conversation plus the answer streamed so far, read again
by the next worker), ``continuation_prompt_tokens`` of them, and ``completion_tokens`` every
token streamed; ``tokens_estimated`` is true when the tokens streamed before a break had to be
estimated. ``usage_estimated`` is true when the worker reported no usage at all (a stream cut
before its usage chunk, a whole answer the client hung up on): the tokens are then the estimate
its key's quotas were charged (``app.proxy.unreported``), never 0 for an answer that was relayed.

``UsageLog.write`` is a deque append: it never blocks, and the request does no formatting and
no I/O. One background thread turns the queued records into lines and writes them in batches,
every ``FLUSH_INTERVAL_S`` (sooner once half the queue is taken), so a busy gateway does not wake
it per request.

When ``usage_log_queue`` lines are already waiting (a slow or stuck disk), or the write fails (a
full disk, a missing directory), the lines are dropped and counted
(``dflash_gateway_usage_log_dropped_lines_total``); a failed write is cut back to the last whole
line, so the file only ever holds whole lines.

Rotation by size: before a line would take the file past ``usage_log_max_bytes`` it becomes
``<file>.1`` (``.1`` becomes ``.2``, ..., keeping ``usage_log_backups``; 0: the file is just
started afresh). Rotation happens between lines. ``close`` (at shutdown) writes what is queued,
waiting a bounded time.

With ``--processes N`` each process writes its own file, ``<stem>.<index><suffix>``
(``usage.jsonl`` → ``usage.0.jsonl``, ``usage.1.jsonl``...), rotated on its own: a process
restarted by the supervisor appends to its index's file again.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import stat
import threading
import time
from collections.abc import Callable, Collection
from pathlib import Path

import orjson

from app.accesslog import AccessRecord
from app.tenants.config import TenantsConfig

log = logging.getLogger(__name__)

FLUSH_TIMEOUT_S = 3.0  # the longest shutdown waits for queued lines
FLUSH_INTERVAL_S = 0.5  # the writer's rounds; sooner when half the queue is taken
_SLICE = 64  # lines serialised between two writes (each write lets the requests' thread run)
_FLAGS = os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_CLOEXEC", 0)


def process_path(path: Path, index: int) -> Path:
    """Process ``index``'s own file under ``--processes N``: ``usage.jsonl`` → ``usage.0.jsonl``."""
    return path.with_name(f"{path.stem}.{index}{path.suffix}")


def usage_line(ended: str, r: AccessRecord) -> bytes:
    """The line for a request whose answer ended at ``ended`` (``rfc3339``)."""
    doc = {
        "time": ended,
        "request_id": r.request_id,
        "client_request_id": r.client_request_id,
        "key": r.key,
        "priority": r.priority,
        "model": r.model,
        "worker": r.worker,
        "route": r.route,
        "stream": r.stream,
        "status": r.status,
        "outcome": r.outcome,
        "prompt_tokens": r.prompt_tokens or 0,
        "completion_tokens": r.completion_tokens or 0,
        "reasoning_tokens": r.reasoning_tokens or 0,
        "accept_length": r.accept_length,
        "ttft_ms": r.ttft_ms,
        "duration_ms": r.duration_ms,
        "attempts": r.attempts,
        "continuations": r.continuations,
        "continuation_prompt_tokens": r.continuation_prompt_tokens,
        "tokens_estimated": r.tokens_estimated,
        "usage_estimated": r.usage_estimated,
    }
    return orjson.dumps(doc) + b"\n"


class UsageLog:
    """Writes usage lines to ``path`` from a background thread (see the module doc)."""

    def __init__(
        self,
        path: Path,
        *,
        max_bytes: int,
        backups: int,
        queue: int,
        dropped: Callable[[int], None],
        wall: Callable[[], float] = time.time,
        crashed: Callable[[], None] = lambda: None,
    ) -> None:
        self.path = path
        self._max_bytes = max_bytes
        self._backups = backups
        self._limit = queue
        self._nudge = max(1, queue // 2)
        self._second = -1  # the second whose RFC 3339 prefix is cached
        self._prefix = ""
        self._dropped = dropped
        self._crashed = crashed
        self._wall = wall
        self._pending: collections.deque[tuple[float, AccessRecord]] = collections.deque()
        self._wake = threading.Event()
        self._closed = False
        self._fd: int | None = None
        self._size = 0
        self._rotates = False  # a regular file (a device such as /dev/full is never renamed)
        self._failing = False  # the last write failed (logged once per failure streak)
        self._stuck = False  # the last rotation failed (logged once per streak)
        self._thread = threading.Thread(target=self._run, name="usage-log", daemon=True)
        self._thread.start()

    @classmethod
    def from_config(
        cls,
        config: TenantsConfig,
        dropped: Callable[[int], None],
        crashed: Callable[[], None] = lambda: None,
    ) -> UsageLog | None:
        if config.usage_log is None:
            return None
        return cls(
            config.usage_log,
            max_bytes=config.usage_log_max_bytes,
            backups=config.usage_log_backups,
            queue=config.usage_log_queue,
            dropped=dropped,
            crashed=crashed,
        )

    # -- the request's side: O(1), never blocks ------------------------------------------------

    def write(self, record: AccessRecord) -> None:
        """Queue ``record``'s line (the record is not changed afterwards), or drop and count it."""
        pending = self._pending
        if self._closed or len(pending) >= self._limit:
            self._dropped(1)
            return
        pending.append((self._wall(), record))
        if len(pending) >= self._nudge and not self._wake.is_set():
            self._wake.set()

    @property
    def queued(self) -> int:
        """Lines waiting for the writer."""
        return len(self._pending)

    def sink(
        self, routes: Collection[str], keyless: Callable[[], bool]
    ) -> Callable[[AccessRecord], None]:
        """An access-log sink that writes the records of ``routes`` with a key name (or any,
        while ``keyless()``: no API keys configured)."""
        write = self.write

        def accept(record: AccessRecord) -> None:
            if record.route in routes and (record.key is not None or keyless()):
                write(record)

        return accept

    def close(self, timeout: float = FLUSH_TIMEOUT_S) -> None:
        """Write what is queued (waiting up to ``timeout``) and stop; later lines are dropped."""
        self._closed = True
        self._wake.set()
        self._thread.join(timeout)
        left = len(self._pending)
        self._pending.clear()
        if left:
            self._dropped(left)
            log.error("usage log: %d lines not written to %s at shutdown", left, self.path)

    # -- the writer thread ---------------------------------------------------------------------

    def _run(self) -> None:
        pending = self._pending
        try:
            while True:
                self._wake.wait(FLUSH_INTERVAL_S)
                self._wake.clear()
                while pending:
                    lines: list[bytes] = []
                    while len(lines) < _SLICE:
                        try:
                            at, record = pending.popleft()
                        except IndexError:  # emptied (or cleared by a close that gave up)
                            break
                        try:
                            lines.append(usage_line(self._stamp(at), record))
                        except Exception:
                            self._crash(1)
                    if lines:
                        try:
                            self._write(lines)
                        except Exception:
                            self._crash(len(lines))
                if self._closed:
                    return
        finally:
            self._close_fd()

    def _crash(self, lines: int) -> None:
        """A bug lost ``lines`` lines: logged with its traceback, counted (dropped lines, and a
        restart of the writer), and the writer goes on with the next lines."""
        log.exception("usage log: the writer crashed (%d lines lost); it goes on", lines)
        self._dropped(lines)
        try:
            self._crashed()
        except Exception:
            log.exception("usage log: the writer's crash not counted")

    def _stamp(self, at: float) -> str:
        """``at`` (wall-clock seconds) as RFC 3339 UTC with milliseconds, e.g.
        ``2026-12-03T12:20:01.250Z``; the date and time are formatted once per second."""
        second = int(at)
        if second != self._second:
            self._second = second
            self._prefix = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second))
        return f"{self._prefix}.{int((at - second) * 1000):03d}Z"

    def _write(self, lines: list[bytes]) -> None:
        """Write whole lines, rotating between two lines when the next would not fit."""
        if self._fd is None:
            self._open()
            if self._fd is None:
                self._dropped(len(lines))
                return
        buf: list[bytes] = []
        size = 0
        for line in lines:
            if self._rotates and self._size + size + len(line) > self._max_bytes:
                if buf:
                    self._flush(buf, size)
                    buf, size = [], 0
                if self._size:
                    self._rotate()
            buf.append(line)
            size += len(line)
        if buf:
            self._flush(buf, size)

    def _open(self) -> None:
        try:
            fd = os.open(self.path, _FLAGS, 0o644)
        except OSError as exc:
            self._failed(exc)
            return
        info = os.fstat(fd)
        self._fd, self._rotates = fd, stat.S_ISREG(info.st_mode)
        self._size = info.st_size if self._rotates else 0

    def _flush(self, buf: list[bytes], size: int) -> None:
        fd = self._fd
        if fd is None:
            self._open()
            fd = self._fd
        if fd is None:
            self._dropped(len(buf))
            return
        data = b"".join(buf)
        done = 0
        try:
            while done < size:
                done += os.write(fd, data[done:])
        except OSError as exc:
            # Keep the whole lines that made it; never leave the start of a line behind.
            whole = data.rfind(b"\n", 0, done) + 1
            if self._rotates and whole < done:
                with contextlib.suppress(OSError):
                    os.ftruncate(fd, self._size + whole)
            self._size += whole
            self._dropped(len(buf) - data.count(b"\n", 0, whole))
            self._failed(exc)
            self._close_fd()  # reopened for the next lines
            return
        self._size += size
        if self._failing:
            self._failing = False
            log.warning("usage log: writing to %s again", self.path)

    def _rotate(self) -> None:
        self._close_fd()
        base = str(self.path)
        try:
            if self._backups == 0:
                os.unlink(base)
            else:
                for i in range(self._backups - 1, 0, -1):
                    with contextlib.suppress(FileNotFoundError):
                        os.replace(f"{base}.{i}", f"{base}.{i + 1}")
                os.replace(base, f"{base}.1")
        except OSError as exc:  # kept growing: better than losing lines
            if not self._stuck:
                log.error("usage log: cannot rotate %s: %s", self.path, exc)
            self._stuck = True
        else:
            self._stuck = False
        self._open()

    def _failed(self, exc: OSError) -> None:
        if not self._failing:
            self._failing = True
            log.error("usage log: cannot write to %s (dropping lines): %s", self.path, exc)

    def _close_fd(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)
