"""Slow clients against a real gateway process, over raw sockets.

Slowloris: headers sent byte by byte, a body trickled in, an idle connection, oversized headers:
each is answered 408/431 and the connection closed, while a normal kept-alive client is served.
Slow reader: a client that stops reading a long stream stalls the worker too (backpressure, seen in
the emulator's live token counter) and the gateway's memory stays flat; reading on, it gets the
whole stream.
"""

from __future__ import annotations

import contextlib
import re
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson
import pytest

from tests.e2e.conftest import poll
from tests.security.stack import CHAT, MODEL, emulator, start_gateway
from tests.support.procs import ManagedProcess, managed_processes

HEADER_S = 1.0
BODY_S = 1.0
MAX_HEADER_BYTES = 4096
SLOW_READER_TOKENS = 400_000


@pytest.fixture(scope="module")
def slow_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ManagedProcess, ...]]:
    with managed_processes(tmp_path_factory, "slow") as manager:
        emu = emulator(manager, "emu", "--speed", "1000")
        gw = start_gateway(
            manager,
            [emu],
            env={
                "DFLASH_GATEWAY_TIMEOUTS__CLIENT_HEADER_S": str(HEADER_S),
                "DFLASH_GATEWAY_TIMEOUTS__CLIENT_BODY_S": str(BODY_S),
                "DFLASH_GATEWAY_LIMITS__MAX_HEADER_BYTES": str(MAX_HEADER_BYTES),
                "DFLASH_GATEWAY_LIMITS__MAX_TOKENS_CAP": str(SLOW_READER_TOKENS),
            },
        )
        yield gw, emu


def _connect(gw: ManagedProcess, rcvbuf: int | None = None) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf is not None:  # before connect, so the window is small from the start
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.settimeout(15)
    sock.connect(("127.0.0.1", gw.port))
    return sock


def _read_all(sock: socket.socket) -> bytes:
    """Everything until the server closes the connection."""
    parts = []
    while True:
        data = sock.recv(65536)
        if not data:
            return b"".join(parts)
        parts.append(data)


def _status(raw: bytes) -> int:
    match = re.match(rb"HTTP/1\.1 (\d{3}) ", raw)
    assert match, raw[:200]
    return int(match.group(1))


def _error_code(raw: bytes) -> str:
    body = orjson.loads(raw.split(b"\r\n\r\n", 1)[1])
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return str(body["error"]["code"])


def _trickle(sock: socket.socket, data: bytes, *, limit_s: float = 20.0) -> bool:
    """Send ``data`` a byte at a time (0.05 s apart) until done or the server closed; True if the
    server closed the connection before everything was sent."""
    deadline = time.monotonic() + limit_s
    for i in range(len(data)):
        try:
            sock.sendall(data[i : i + 1])
        except (BrokenPipeError, ConnectionResetError):
            return True
        if time.monotonic() > deadline:
            raise AssertionError("the gateway kept accepting a trickle for too long")
        time.sleep(0.05)
        if i % 4 == 0:
            sock.setblocking(False)
            try:
                if sock.recv(1, socket.MSG_PEEK):
                    return True  # an answer came: the server gave up on us
            except BlockingIOError:
                pass
            finally:
                sock.setblocking(True)
    return False


def _alive(gw: ManagedProcess) -> None:
    assert httpx.get(gw.url + "/livez", timeout=5).status_code == 200


def test_headers_sent_byte_by_byte_are_timed_out(slow_stack: tuple[ManagedProcess, ...]) -> None:
    gw, _ = slow_stack
    endless = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n" + b"".join(
        b"X-Pad-%d: %s\r\n" % (i, b"a" * 8) for i in range(2000)
    )
    with _connect(gw) as sock:
        assert _trickle(sock, endless), "every header byte was accepted"
        answer = _read_all(sock)
    assert _status(answer) == 408
    assert _error_code(answer) == "request_timeout"
    assert b"connection: close" in answer.lower()
    _alive(gw)


def test_idle_connection_is_closed_without_an_answer(
    slow_stack: tuple[ManagedProcess, ...],
) -> None:
    gw, _ = slow_stack
    with _connect(gw) as sock:
        answer = _read_all(sock)  # sends nothing; the server closes (well within the 15 s)
    assert answer == b""


def test_body_trickled_in_is_timed_out(slow_stack: tuple[ManagedProcess, ...]) -> None:
    gw, _ = slow_stack
    body = orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x" * 2000}]})
    head = (
        f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    with _connect(gw) as sock:
        sock.sendall(head)
        assert _trickle(sock, body), "the whole trickled body was accepted"
        answer = _read_all(sock)
    assert _status(answer) == 408
    _alive(gw)


def test_oversized_headers_are_431(slow_stack: tuple[ManagedProcess, ...]) -> None:
    gw, _ = slow_stack
    request = (
        b"GET /livez HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (2 * MAX_HEADER_BYTES) + b"\r\n\r\n"
    )
    with _connect(gw) as sock:
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            sock.sendall(request)
        answer = _read_all(sock)
    assert _status(answer) == 431
    assert _error_code(answer) == "request_header_fields_too_large"


def test_kept_alive_connection_gets_a_fresh_header_deadline(
    slow_stack: tuple[ManagedProcess, ...],
) -> None:
    gw, _ = slow_stack
    request = b"GET /livez HTTP/1.1\r\nHost: x\r\n\r\n"
    with _connect(gw) as sock:
        sock.sendall(request)
        assert _status(_read_response(sock)) == 200
        # Idle for longer than the header deadline (not the keep-alive timeout, client_keepalive_s):
        # the deadline runs per request, from its first byte.
        time.sleep(HEADER_S * 1.5)
        sock.sendall(request)
        assert _status(_read_response(sock)) == 200


def _read_response(sock: socket.socket) -> bytes:
    """One whole Content-Length response from a kept-alive connection."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, "connection closed"
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    length = int(re.search(rb"(?i)content-length: (\d+)", head).group(1))  # type: ignore[union-attr]
    while len(body) < length:
        chunk = sock.recv(65536)
        assert chunk, "connection closed"
        body += chunk
    return head + b"\r\n\r\n" + body


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def _tokens_generated(emu: ManagedProcess) -> float:
    """The emulator's live count of generated stream tokens (one sample per token)."""
    text = httpx.get(emu.url + "/metrics", timeout=5).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith("sglang:inter_token_latency_seconds_count"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_slow_reader_backpressure_reaches_the_worker(
    slow_stack: tuple[ManagedProcess, ...],
) -> None:
    gw, emu = slow_stack
    _alive(gw)
    baseline_rss = _rss_kib(gw.pid)
    before = _tokens_generated(emu)
    body = orjson.dumps(
        {
            "model": MODEL,
            "stream": True,
            "ignore_eos": True,  # SGLang's: generate exactly max_tokens (~28 MB of events)
            "max_tokens": SLOW_READER_TOKENS,
            "messages": [{"role": "user", "content": "Tell me a long story."}],
        }
    )
    head = (
        f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    # A receive buffer as big as loopback's MSS (64 KiB): smaller ones make Linux's silly-window
    # avoidance, not the gateway, pace the stream once the client reads again.
    with _connect(gw, rcvbuf=65536) as sock:
        sock.settimeout(60)
        sock.sendall(head + body)
        first = sock.recv(4096)
        assert _status(first) == 200
        # Now read nothing. The worker must stop generating once the buffers on the way are full.
        samples: list[float] = []

        def stalled() -> bool:
            samples.append(_tokens_generated(emu) - before)
            return len(samples) >= 3 and samples[-1] == samples[-3] > 0

        poll(stalled, timeout=30, interval=0.5)
        generated = samples[-1]
        assert generated < SLOW_READER_TOKENS / 2, f"{generated} tokens made for a stalled client"
        grown_kib = _rss_kib(gw.pid) - baseline_rss
        assert grown_kib < 16 * 1024, f"gateway RSS grew by {grown_kib} KiB for one stalled client"
        print(f"stalled after {generated:.0f} of {SLOW_READER_TOKENS} tokens; RSS +{grown_kib} KiB")
        # Reading on, the client gets the whole stream.
        rest = _read_until_done(sock)
    assert rest.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n")  # chunked transfer's last chunk
    assert _tokens_generated(emu) - before == SLOW_READER_TOKENS


def _read_until_done(sock: socket.socket) -> bytes:
    tail = b""
    while True:
        data = sock.recv(1 << 20)
        if not data:
            return tail
        tail = (tail + data)[-64:]
        if tail.endswith(b"0\r\n\r\n") and b"[DONE]" in tail:
            return tail
