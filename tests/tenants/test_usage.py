"""The usage log on a real filesystem: whole JSON lines with every field, size rotation between
lines, a bounded queue whose overflow is dropped and counted, disk errors that drop and count
without reaching the request, and the queue written out at close."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import orjson
import pytest

from app.accesslog import AccessLog, AccessRecord
from app.outcomes import Outcome
from app.tenants.usage import UsageLog, process_path

FIELDS = [
    "time",
    "request_id",
    "client_request_id",
    "key",
    "priority",
    "model",
    "worker",
    "route",
    "stream",
    "status",
    "outcome",
    "prompt_tokens",
    "completion_tokens",
    "reasoning_tokens",
    "accept_length",
    "ttft_ms",
    "duration_ms",
    "attempts",
    "continuations",
    "continuation_prompt_tokens",
    "tokens_estimated",
    "usage_estimated",
]
ROUTE = "/v1/chat/completions"


class Drops:
    """The drop counter (``Metrics.record_usage_log_dropped``'s signature), thread-safe."""

    def __init__(self) -> None:
        self.count = 0
        self._lock = threading.Lock()

    def __call__(self, lines: int = 1) -> None:
        with self._lock:
            self.count += lines


def poll(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not met"
        time.sleep(0.01)


def record(i: int, key: str | None = "team-a") -> AccessRecord:
    r = AccessRecord(f"req-{i}", ROUTE, "moonshotai/Kimi-K2.5", i % 2 == 0, key=key)
    r.priority, r.worker, r.status, r.attempts = "normal", "w:1", 200, 1
    r.prompt_tokens, r.completion_tokens, r.reasoning_tokens = 10 + i, 100 + i, 50
    r.accept_length, r.ttft_ms, r.duration_ms = 4.25, 12.5, 340.0
    return r


def usage_log(path: Path, drops: Drops, **kw: int) -> UsageLog:
    settings = {"max_bytes": 1 << 20, "backups": 2, "queue": 10_000} | kw
    return UsageLog(path, dropped=drops, **settings)


def lines(path: Path) -> list[dict[str, object]]:
    data = path.read_bytes()
    assert data == b"" or data.endswith(b"\n")
    return [orjson.loads(line) for line in data.splitlines()]


def test_lines_are_json_with_every_field_in_order(tmp_path: Path) -> None:
    path, drops = tmp_path / "usage.jsonl", Drops()
    log = usage_log(path, drops, wall=lambda: 1796300401.25)
    log.write(record(1))
    refused = AccessRecord("req-2", ROUTE, "-", False, key="team-b", status=429)
    refused.outcome = Outcome.REJECTED
    log.write(refused)
    log.close()
    first, second = lines(path)
    assert list(first) == FIELDS
    assert first["time"] == "2026-12-03T12:20:01.250Z"
    assert first["key"] == "team-a" and first["request_id"] == "req-1"
    assert (first["prompt_tokens"], first["completion_tokens"], first["reasoning_tokens"]) == (
        11,
        101,
        50,
    )
    assert first["outcome"] == "ok" and first["stream"] is False and first["accept_length"] == 4.25
    # A refused request: zero tokens, not null.
    assert second["status"] == 429 and second["outcome"] == "rejected"
    assert (second["prompt_tokens"], second["completion_tokens"], second["reasoning_tokens"]) == (
        0,
        0,
        0,
    )
    assert second["worker"] is None and second["ttft_ms"] is None
    assert drops.count == 0


def test_rotation_keeps_whole_lines_and_the_newest_backups(tmp_path: Path) -> None:
    path, drops = tmp_path / "usage.jsonl", Drops()
    max_bytes = 4096
    log = usage_log(path, drops, max_bytes=max_bytes, backups=2)
    for i in range(200):  # ~60 KB: many rotations
        log.write(record(i))
    log.close()
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["usage.jsonl", "usage.jsonl.1", "usage.jsonl.2"]
    ids: list[int] = []
    longest = 0
    for name in ("usage.jsonl.2", "usage.jsonl.1", "usage.jsonl"):
        f = tmp_path / name
        assert 0 < f.stat().st_size <= max_bytes
        ids += [int(str(line["request_id"])[4:]) for line in lines(f)]
        longest = max(longest, *(len(raw) + 1 for raw in f.read_bytes().splitlines()))
    # The newest lines, in order, with none lost between the files kept; the rotated files full.
    assert ids == list(range(200 - len(ids), 200))
    assert len(ids) >= 2 * (max_bytes // longest)
    assert drops.count == 0


def test_rotation_without_backups_starts_the_file_afresh(tmp_path: Path) -> None:
    path, drops = tmp_path / "usage.jsonl", Drops()
    log = usage_log(path, drops, max_bytes=4096, backups=0)
    for i in range(100):
        log.write(record(i))
    log.close()
    assert [p.name for p in tmp_path.iterdir()] == ["usage.jsonl"]
    assert path.stat().st_size <= 4096
    assert lines(path)[-1]["request_id"] == "req-99"


def test_an_existing_file_is_appended_to_and_counts_towards_rotation(tmp_path: Path) -> None:
    path, drops = tmp_path / "usage.jsonl", Drops()
    path.write_bytes(b'{"old": true}\n' * 290)  # 4060 bytes: the next line does not fit
    log = usage_log(path, drops, max_bytes=4096, backups=1)
    log.write(record(1))
    log.close()
    assert len(lines(tmp_path / "usage.jsonl.1")) == 290
    assert [line["request_id"] for line in lines(path)] == ["req-1"]


def test_a_full_queue_drops_and_counts_and_never_blocks(tmp_path: Path) -> None:
    """The writer is stuck opening a FIFO nobody reads (a hung disk): writes return at once and
    everything past the queue's bound is dropped and counted."""
    path, drops = tmp_path / "usage.fifo", Drops()
    os.mkfifo(path)
    log = usage_log(path, drops, queue=5)
    log.write(record(0))
    log.write(record(1))  # half the queue: the writer takes both, and hangs opening the file
    poll(lambda: log.queued == 0)
    for i in range(2, 22):
        log.write(record(i))
    assert (log.queued, drops.count) == (5, 15)
    reader = os.open(path, os.O_RDONLY)  # the disk comes back
    try:
        log.close()
        data = b""
        while chunk := os.read(reader, 1 << 16):
            data += chunk
    finally:
        os.close(reader)
    written = [orjson.loads(line)["request_id"] for line in data.splitlines()]
    assert written == [f"req-{i}" for i in (0, 1, 2, 3, 4, 5, 6)]


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_a_full_disk_drops_and_counts_without_raising(tmp_path: Path) -> None:
    drops = Drops()
    log = usage_log(Path("/dev/full"), drops)
    access = AccessLog(log.sink({ROUTE}, lambda: False))
    for i in range(10):
        access.emit(record(i))  # what the request does: it never sees the error
    log.close()
    assert drops.count == 10


def test_a_missing_directory_drops_and_counts(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    drops = Drops()
    log = usage_log(blocker / "usage.jsonl", drops)
    for i in range(7):
        log.write(record(i))
    log.close()
    assert drops.count == 7


def test_lines_after_close_are_dropped_and_counted(tmp_path: Path) -> None:
    path, drops = tmp_path / "usage.jsonl", Drops()
    log = usage_log(path, drops)
    log.write(record(1))
    log.close()
    log.write(record(2))
    assert drops.count == 1
    assert [line["request_id"] for line in lines(path)] == ["req-1"]


def test_close_writes_everything_queued(tmp_path: Path) -> None:
    path, drops = tmp_path / "usage.jsonl", Drops()
    log = usage_log(path, drops)
    for i in range(2000):
        log.write(record(i))
    log.close()
    assert len(lines(path)) == 2000 and drops.count == 0


def test_the_sink_takes_billable_routes_with_a_key(tmp_path: Path) -> None:
    path, drops = tmp_path / "usage.jsonl", Drops()
    log = usage_log(path, drops)
    keyless = False
    access = AccessLog(log.sink({ROUTE}, lambda: keyless))
    access.emit(record(1))
    access.emit(record(2, key=None))  # a 401 while keys are configured: no one's
    probe = AccessRecord("req-3", "/readyz", "-", False, status=200)
    access.emit(probe)
    keyless = True  # no keys configured: every request is billable, key null
    access.emit(record(4, key=None))
    log.close()
    assert [(line["request_id"], line["key"]) for line in lines(path)] == [
        ("req-1", "team-a"),
        ("req-4", None),
    ]


def test_a_write_cut_short_leaves_only_whole_lines(tmp_path: Path) -> None:
    """A file size limit (RLIMIT_FSIZE) cuts a write part-way: the partial line is taken back."""
    path = tmp_path / "usage.jsonl"
    script = f"""
import resource, signal
from pathlib import Path
from app.tenants.usage import UsageLog
from tests.tenants.test_usage import record, Drops
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (3000, 3000))
drops = Drops()
log = UsageLog(Path({str(path)!r}), max_bytes=1 << 20, backups=1, queue=100, dropped=drops)
for i in range(20):
    log.write(record(i))
log.close()
print(drops.count)
"""
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=60
    )
    dropped = int(done.stdout.strip())
    kept = lines(path)
    assert dropped > 0 and kept
    assert len(kept) + dropped == 20
    assert path.stat().st_size <= 3000


def test_each_process_has_its_own_file() -> None:
    assert process_path(Path("/var/log/usage.jsonl"), 1) == Path("/var/log/usage.1.jsonl")
    assert process_path(Path("usage"), 0) == Path("usage.0")


def test_a_line_that_cannot_be_written_is_dropped_and_the_writer_goes_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path, drops, crashes = tmp_path / "usage.jsonl", Drops(), list[int]()
    log = UsageLog(
        path,
        max_bytes=1 << 20,
        backups=2,
        queue=10_000,
        dropped=drops,
        crashed=lambda: crashes.append(1),
    )
    bad = record(1)
    bad.completion_tokens = 2**70  # a bug upstream of the writer: no JSON integer this large
    with caplog.at_level(logging.ERROR, logger="app.tenants.usage"):
        log.write(bad)
        log.write(record(2))
        log.close()
    assert [line["request_id"] for line in lines(path)] == ["req-2"]
    assert (drops.count, len(crashes)) == (1, 1)
    assert any(r.exc_info is not None for r in caplog.records)
