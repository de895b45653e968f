"""The server's own refusals (408/431) against a real gateway process, over raw sockets: they never
break into another answer on the connection, each request is recorded exactly once, and a head's
size verdict does not depend on how TCP splits it.
"""

from __future__ import annotations

import contextlib
import re
import socket
import time
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest

from tests.e2e.conftest import poll
from tests.security.stack import CHAT, MODEL, chat, emulator, start_gateway
from tests.support.procs import ManagedProcess, managed_processes

BODY_S = 0.5
MAX_HEADER_BYTES = 4096
STREAM_TOKENS = 600  # at the emulator's speed, a stream that outlasts BODY_S several times


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ManagedProcess]:
    with managed_processes(tmp_path_factory, "order") as manager:
        emu = emulator(manager, "emu", "--speed", "4")
        yield start_gateway(
            manager,
            [emu],
            env={
                "DFLASH_GATEWAY_TIMEOUTS__CLIENT_BODY_S": str(BODY_S),
                "DFLASH_GATEWAY_LIMITS__MAX_HEADER_BYTES": str(MAX_HEADER_BYTES),
                "DFLASH_GATEWAY_LOG_JSON": "true",
            },
        )


def _read_all(sock: socket.socket) -> bytes:
    parts = []
    with contextlib.suppress(ConnectionResetError):
        while data := sock.recv(65536):
            parts.append(data)
    return b"".join(parts)


def _status(raw: bytes) -> int:
    match = re.match(rb"HTTP/1\.1 (\d{3}) ", raw)
    assert match, raw[:200]
    return int(match.group(1))


def _access_lines(gw: ManagedProcess) -> list[dict[str, Any]]:
    lines = []
    for line in gw.logs().splitlines():
        if line.startswith("{"):
            doc = orjson.loads(line)
            if doc.get("logger") == "dflash_gateway.access":
                lines.append(doc)
    return lines


def _requests_total(gw: ManagedProcess, status: int) -> float:
    text = httpx.get(gw.url + "/metrics", timeout=10).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("dflash_gateway_requests_total{") and f'status="{status}"' in line
    )


def _head(path: str, length: int, *extra: bytes) -> bytes:
    return (
        b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n%s\r\n" % (path.encode(), length, b"".join(extra))
    )


def _settled(gw: ManagedProcess, request_id: str) -> list[dict[str, Any]]:
    """Access lines once a later request (``request_id``) was recorded: anything the gateway
    still had to record about earlier ones is in by then."""
    response = httpx.post(
        gw.url + CHAT, json=chat(), headers={"x-request-id": request_id}, timeout=30
    )
    assert response.status_code == 200
    poll(lambda: any(line.get("client_request_id") == request_id for line in _access_lines(gw)))
    return _access_lines(gw)


# A pipelined request's refusal never lands inside the answer ahead of it

_STREAM = orjson.dumps(
    {
        "model": MODEL,
        "stream": True,
        "ignore_eos": True,
        "max_tokens": STREAM_TOKENS,
        "messages": [{"role": "user", "content": "Tell me a long story."}],
    }
)


def test_a_pipelined_request_waits_for_the_stream_ahead_of_it(gw: ManagedProcess) -> None:
    first = _head(CHAT, len(_STREAM), b"X-Request-Id: pipe-first\r\n") + _STREAM
    # The next request's head and the start of its body; the rest never comes.
    second = _head(CHAT, 100, b"X-Request-Id: pipe-second\r\n") + b"{"
    with socket.create_connection(("127.0.0.1", gw.port), timeout=60) as sock:
        sock.sendall(first + second)
        answer = _read_all(sock)
    assert _status(answer) == 200
    stream, _, after = answer.partition(b"data: [DONE]\n\n\r\n0\r\n\r\n")
    assert after, "the stream did not end with its end marker and last chunk"
    assert b"HTTP/1.1" not in stream.split(b"\r\n\r\n", 1)[1], "a response inside the stream"
    # The second request was read once the stream ended; its body never came: a 408 after it.
    assert _status(after) == 408
    lines = _settled(gw, "pipe-after")
    (streamed,) = [line for line in lines if line.get("client_request_id") == "pipe-first"]
    assert streamed["status"] == 200
    assert streamed["completion_tokens"] == STREAM_TOKENS


def test_a_pipelined_refusal_follows_the_stream_ahead_of_it(gw: ManagedProcess) -> None:
    first = _head(CHAT, len(_STREAM), b"X-Request-Id: pipe-431\r\n") + _STREAM
    second = _head(CHAT, 2, b"X-Pad: %s\r\n" % (b"a" * MAX_HEADER_BYTES)) + b"{}"
    with socket.create_connection(("127.0.0.1", gw.port), timeout=60) as sock:
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            sock.sendall(first + second)
        answer = _read_all(sock)
    assert _status(answer) == 200
    stream, _, after = answer.partition(b"data: [DONE]\n\n\r\n0\r\n\r\n")
    assert after, "the stream did not end with its end marker and last chunk"
    assert b"HTTP/1.1" not in stream.split(b"\r\n\r\n", 1)[1], "a response inside the stream"
    assert _status(after) == 431


def _responses(raw: bytes) -> list[tuple[int, dict[bytes, bytes], bytes]]:
    """Whole responses with a content-length, one after the other: status, headers, body."""
    out = []
    while raw:
        head, _, rest = raw.partition(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        headers = dict(line.lower().split(b": ", 1) for line in lines[1:])
        length = int(headers[b"content-length"])
        out.append((_status(head), headers, rest[:length]))
        raw = rest[length:]
    return out


def test_whole_answers_keep_their_order_and_the_connection(gw: ManagedProcess) -> None:
    """Non-streamed answers, pipelined on one connection: each whole and in order, the
    connection kept until the client's ``Connection: close``."""
    body = orjson.dumps(chat())
    ids = [b"whole-1", b"whole-2", b"whole-3"]
    heads = [_head(CHAT, len(body), b"X-Request-Id: %s\r\n" % i) for i in ids[:2]]
    heads.append(_head(CHAT, len(body), b"X-Request-Id: whole-3\r\nConnection: close\r\n"))
    with socket.create_connection(("127.0.0.1", gw.port), timeout=60) as sock:
        sock.sendall(b"".join(head + body for head in heads))
        answers = _responses(_read_all(sock))  # to the end: the gateway closes after the third
    assert [status for status, _, _ in answers] == [200, 200, 200]
    # In order: each answer carries its own request's X-Request-Id.
    assert [headers[b"x-request-id"] for _, headers, _ in answers] == ids
    assert [headers.get(b"connection") for _, headers, _ in answers] == [None, None, b"close"]
    for _, headers, text in answers:
        assert headers[b"content-type"] == b"application/json"
        doc = orjson.loads(text)
        assert doc["usage"]["completion_tokens"] == 16
        assert "meta_info" not in doc["choices"][0]


# One slow body: one answer, one access line, one count


def test_a_body_too_slow_is_recorded_once(gw: ManagedProcess) -> None:
    before_408, before_499 = _requests_total(gw, 408), _requests_total(gw, 499)
    before = len(_settled(gw, "slow-before"))
    with socket.create_connection(("127.0.0.1", gw.port), timeout=30) as sock:
        sock.sendall(_head(CHAT, 100, b"X-Request-Id: slow-body\r\n") + b'{"mo')
        answer = _read_all(sock)
    assert _status(answer) == 408
    lines = [line for line in _settled(gw, "slow-after")[before:] if line["route"] == CHAT]
    assert [line["status"] for line in lines] == [408, 200]
    assert _requests_total(gw, 408) == before_408 + 1
    assert _requests_total(gw, 499) == before_499


# The head's size limit, whatever the segmentation


def _sized_head(size: int) -> bytes:
    """A GET /livez head of exactly ``size`` bytes, its blank line included."""
    start = b"GET /livez HTTP/1.1\r\nHost: x\r\nConnection: close\r\nX-Pad: "
    pad = size - len(start) - 4
    return start + b"a" * pad + b"\r\n\r\n"


@pytest.mark.parametrize(
    ("size", "status"),
    [(MAX_HEADER_BYTES, 200), (MAX_HEADER_BYTES + 1, 431), (MAX_HEADER_BYTES + 10, 431)],
)
@pytest.mark.parametrize("split", [0, 2, 3, 200])
def test_the_head_limit_does_not_depend_on_segmentation(
    gw: ManagedProcess, size: int, status: int, split: int
) -> None:
    """The head arrives whole, or in two reads with the last ``split`` bytes apart."""
    head = _sized_head(size)
    assert len(head) == size
    with socket.create_connection(("127.0.0.1", gw.port), timeout=30) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            if split:
                sock.sendall(head[:-split])
                time.sleep(0.2)  # two reads, not one
                sock.sendall(head[-split:])
            else:
                sock.sendall(head)
        answer = _read_all(sock)
    assert _status(answer) == status
