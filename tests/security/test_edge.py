"""Hostile clients at the gateway's edge, over raw sockets against a real gateway process.

An endless header line, too many connections, a trailing-slash path with a forged Host, bodies
that are not JSON (a browser's blind cross-site POST) or are encoded, repeated Authorization
headers: each is refused in OpenAI shape, and every refusal leaves an access-log line and a
``requests_total`` count.
"""

from __future__ import annotations

import contextlib
import re
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from tests.e2e.conftest import poll
from tests.security.stack import CHAT, MODEL, chat, emulator, error_of, start_gateway
from tests.support.procs import ManagedProcess, ProcessManager, managed_processes

KEY = "sk-edge-3c4d5e6f7a8b9c0d1e2f"
OTHER_KEY = "sk-edge-other-99887766554433"
AUTH = {"authorization": f"Bearer {KEY}"}
MAX_HEADER_BYTES = 4096
MAX_CONNECTIONS = 4


@pytest.fixture(scope="module")
def edge(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ManagedProcess]:
    with managed_processes(tmp_path_factory, "edge") as manager:
        emu = emulator(manager, "emu", "--speed", "1000")
        yield start_gateway(
            manager,
            [emu],
            args=("--api-key", f"team-edge:{KEY}", "--api-key", f"team-other:{OTHER_KEY}"),
            env={
                "DFLASH_GATEWAY_LIMITS__MAX_HEADER_BYTES": str(MAX_HEADER_BYTES),
                "DFLASH_GATEWAY_TIMEOUTS__CLIENT_HEADER_S": "30",
                "DFLASH_GATEWAY_LOG_JSON": "true",
            },
        )


def _connect(gw: ManagedProcess) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", gw.port), timeout=15)
    return sock


def _read_all(sock: socket.socket) -> bytes:
    """Everything until the server closes the connection (a reset after an answer ends it too)."""
    parts = []
    with contextlib.suppress(ConnectionResetError):
        while data := sock.recv(65536):
            parts.append(data)
    return b"".join(parts)


def _answer(raw: bytes) -> tuple[int, dict[bytes, bytes], dict[str, Any]]:
    """Status, headers (lower-case names) and OpenAI error object of one raw response."""
    match = re.match(rb"HTTP/1\.1 (\d{3}) ", raw)
    assert match, raw[:200]
    head, body = raw.split(b"\r\n\r\n", 1)
    headers = dict(
        (name.strip().lower(), value.strip())
        for name, value in (line.split(b":", 1) for line in head.split(b"\r\n")[1:])
    )
    error = orjson.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return int(match.group(1)), headers, error


def _rss_kib(pid: int, field: str = "VmRSS") -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {field}")


def _access_lines(gw: ManagedProcess, request_id: str) -> list[dict[str, Any]]:
    lines = []
    for line in gw.logs().splitlines():
        if request_id in line and line.startswith("{"):
            doc = orjson.loads(line)
            ids = (doc.get("request_id"), doc.get("client_request_id"))
            if doc.get("logger") == "dflash_gateway.access" and request_id in ids:
                lines.append(doc)
    return lines


def _requests_total(gw: ManagedProcess, **labels: str) -> float:
    ops = {"authorization": f"Bearer {KEY}"}  # keys are configured: /metrics needs one
    text = httpx.get(gw.url + "/metrics", headers=ops, timeout=10).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith("dflash_gateway_requests_total{") and all(
            f'{k}="{v}"' in line for k, v in labels.items()
        ):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _post(gw: ManagedProcess, body: bytes, headers: dict[str, str], path: str = CHAT) -> Any:
    return httpx.post(gw.url + path, content=body, headers=headers, timeout=30)


# 1. Header bytes are counted as they arrive


def test_a_header_line_that_never_ends_is_431_once_over_the_limit(edge: ManagedProcess) -> None:
    before = _requests_total(edge, route="other", status="431")
    with _connect(edge) as sock:
        sock.sendall(b"GET /livez HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (2 * MAX_HEADER_BYTES))
        answer = _read_all(sock)
    status, headers, error = _answer(answer)
    assert status == 431
    assert error["code"] == "request_header_fields_too_large"
    assert headers[b"connection"] == b"close"
    request_id = headers[b"x-request-id"].decode()
    (line,) = _access_lines(edge, request_id)
    assert (line["status"], line["route"], line["outcome"]) == (431, "other", "rejected")
    assert _requests_total(edge, route="other", status="431") == before + 1


def test_an_endless_header_line_costs_no_memory(edge: ManagedProcess) -> None:
    """64 MiB of one header value, sent until the gateway closes the connection: the gateway's
    peak RSS barely moves (it used to buffer all of it)."""
    with contextlib.suppress(OSError):  # start the peak (VmHWM) from the current RSS
        Path(f"/proc/{edge.pid}/clear_refs").write_text("5")
    baseline = max(_rss_kib(edge.pid), _rss_kib(edge.pid, "VmHWM"))
    piece = b"a" * (256 * 1024)
    sent = 0
    with _connect(edge) as sock:
        sock.sendall(b"GET /livez HTTP/1.1\r\nHost: x\r\nX-Big: ")
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            while sent < 64 * 1024 * 1024:
                sock.sendall(piece)
                sent += len(piece)
    grown_kib = _rss_kib(edge.pid, "VmHWM") - baseline
    print(f"sent {sent >> 20} MiB before the close; peak RSS +{grown_kib} KiB")
    assert sent < 64 * 1024 * 1024, "the gateway read all 64 MiB of one header line"
    assert grown_kib < 5 * 1024, f"gateway peak RSS grew by {grown_kib} KiB"
    assert httpx.get(edge.url + "/livez", timeout=5).status_code == 200


# 4. Trailing slash


def test_a_trailing_slash_is_a_404_never_a_redirect_to_the_hosts_name(
    edge: ManagedProcess,
) -> None:
    for method, path in (("POST", CHAT + "/"), ("POST", "/v1/completions/"), ("GET", "/livez/")):
        response = httpx.request(
            method,
            edge.url + path,
            json=chat(),
            headers={**AUTH, "host": "evil.example"},
            timeout=10,
        )
        assert response.status_code == 404, (path, response.status_code)
        assert "location" not in response.headers
        assert error_of(response)["code"] == "not_found"


# 5. JSON only, never encoded


@pytest.mark.parametrize(
    "headers",
    [
        {"content-type": "text/plain"},  # what a browser may send cross-site without preflight
        {"content-type": "application/x-www-form-urlencoded"},
        {"content-type": "multipart/form-data; boundary=x"},
        {},  # no Content-Type at all
        {"content-type": "application/jsonx"},
        {"content-type": "application/json", "content-encoding": "gzip"},
        {"content-type": "application/json", "content-encoding": "identity, gzip"},
    ],
)
def test_a_body_that_is_not_plain_json_is_415(
    edge: ManagedProcess, headers: dict[str, str]
) -> None:
    response = _post(edge, orjson.dumps(chat()), {**AUTH, **headers})
    assert response.status_code == 415, response.text
    error = error_of(response)
    assert error["code"] == "unsupported_media_type"
    assert error["param"] in ("content-type", "content-encoding")


@pytest.mark.parametrize(
    "content_type",
    ["application/json", "application/json; charset=utf-8", "Application/JSON ;charset=UTF-8"],
)
def test_json_with_parameters_is_served(edge: ManagedProcess, content_type: str) -> None:
    headers = {**AUTH, "content-type": content_type, "content-encoding": "identity"}
    response = _post(edge, orjson.dumps(chat()), headers)
    assert response.status_code == 200, response.text
    assert response.json()["model"] == MODEL


# 6. One Authorization header


def _raw_request(gw: ManagedProcess, head: bytes, body: bytes = b"") -> bytes:
    with _connect(gw) as sock:
        sock.sendall(head + b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body) + body)
        return _read_all(sock)


@pytest.mark.parametrize("keys", [(KEY, "sk-wrong"), ("sk-wrong", KEY), (KEY, OTHER_KEY)])
def test_two_authorization_headers_are_400_on_every_route(
    edge: ManagedProcess, keys: tuple[str, str]
) -> None:
    auth = b"".join(b"Authorization: Bearer %s\r\n" % key.encode() for key in keys)
    body = orjson.dumps(chat())
    for method, path in ((b"POST", CHAT.encode()), (b"GET", b"/v1/models")):
        head = b"%s %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" % (method, path)
        status, _, error = _answer(_raw_request(edge, head + auth, body))
        assert status == 400, (path, keys)
        assert error["param"] == "authorization"


# 7. Every refusal leaves a trace


@pytest.mark.parametrize(
    ("status", "headers", "body"),
    [
        (400, {**AUTH, "content-type": "application/json"}, b"{not json"),
        (401, {"content-type": "application/json"}, orjson.dumps(chat())),
        (413, {**AUTH, "content-type": "application/json"}, b" " * (9 * 1024 * 1024)),
        (415, {**AUTH, "content-type": "text/plain"}, orjson.dumps(chat())),
        (404, {**AUTH, "content-type": "application/json"}, orjson.dumps(chat(model="nope"))),
    ],
)
def test_every_refused_request_has_an_access_line_and_a_count(
    edge: ManagedProcess, status: int, headers: dict[str, str], body: bytes
) -> None:
    before = _requests_total(edge, route=CHAT, status=str(status))
    request_id = f"edge-{status}-{len(body)}"
    response = _post(edge, body, {**headers, "x-request-id": request_id})
    assert response.status_code == status
    lines = poll(lambda: _access_lines(edge, request_id))
    assert len(lines) == 1
    assert (lines[0]["status"], lines[0]["route"], lines[0]["outcome"]) == (
        status,
        CHAT,
        "rejected",
    )
    assert _requests_total(edge, route=CHAT, status=str(status)) == before + 1


def test_answers_outside_the_completion_routes_are_logged(edge: ManagedProcess) -> None:
    for path, status in (("/v1/models", 401), ("/v1/nothing", 404), ("/livez", 200)):
        request_id = f"edge-get-{status}"
        response = httpx.get(edge.url + path, headers={"x-request-id": request_id}, timeout=10)
        assert response.status_code == status
        (line,) = poll(lambda rid=request_id: _access_lines(edge, rid))
        assert line["status"] == status
        assert line["route"] == (path if path != "/v1/nothing" else "other")


def test_an_unmatched_route_is_logged_with_its_method_and_path(edge: ManagedProcess) -> None:
    """An operator sees which endpoint a client wanted: the method and the path as sent, with
    what could forge or garble a log line escaped and the length capped."""
    long_path = "/v1/" + "x" * 400
    response = httpx.request(
        "PUT", edge.url + long_path, headers={"x-request-id": "edge-unmatched-long"}, timeout=10
    )
    assert response.status_code == 404
    (line,) = poll(lambda: _access_lines(edge, "edge-unmatched-long"))
    assert (line["route"], line["method"]) == ("other", "PUT")
    assert len(line["path"]) == 200 and line["path"] == long_path[:197] + "..."

    with _connect(edge) as sock:  # bytes no client library would send
        sock.sendall(
            b'DELETE /a"b\\c%0A HTTP/1.1\r\nHost: x\r\n'
            b"X-Request-Id: edge-unmatched-raw\r\nConnection: close\r\n\r\n"
        )
        assert _read_all(sock).startswith(b"HTTP/1.1 404 ")
    (line,) = poll(lambda: _access_lines(edge, "edge-unmatched-raw"))
    assert (line["route"], line["method"]) == ("other", "DELETE")
    assert line["path"] == "/a\\x22b\\x5cc%0A"  # as sent, not decoded: no newline


def test_probes_of_coding_agents_are_answered(edge: ManagedProcess) -> None:
    """Claude Code sends ``HEAD /`` or ``HEAD /api/hello`` before its first request."""
    for path in ("/", "/api/hello"):
        request_id = f"edge-probe-{len(path)}"
        response = httpx.head(edge.url + path, headers={"x-request-id": request_id}, timeout=10)
        assert response.status_code == 200
        (line,) = poll(lambda rid=request_id: _access_lines(edge, rid))
        assert (line["route"], line["status"], line["outcome"]) == (path, 200, "ok")
        assert "path" not in line


def test_a_timed_out_request_is_logged_with_its_route(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    manager = ProcessManager(Path(tmp_path_factory.mktemp("edge408")))
    try:
        emu = emulator(manager, "emu", "--speed", "1000")
        gw = start_gateway(
            manager,
            [emu],
            env={"DFLASH_GATEWAY_TIMEOUTS__CLIENT_BODY_S": "0.5", "DFLASH_GATEWAY_LOG_JSON": "1"},
        )
        with _connect(gw) as sock:  # headers, then half the body, then nothing
            sock.sendall(
                b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: 100\r\n\r\n{" % CHAT.encode()
            )
            status, headers, _ = _answer(_read_all(sock))
        assert status == 408
        (line,) = poll(lambda: _access_lines(gw, headers[b"x-request-id"].decode()))
        assert (line["status"], line["route"]) == (408, CHAT)
        assert _requests_total(gw, route=CHAT, status="408") == 1
    finally:
        manager.stop_all()


# 2. A cap on connections


def test_connections_over_the_cap_get_503_and_are_closed(procs: ProcessManager) -> None:
    emu = emulator(procs, "emu", "--speed", "1000")
    gw = start_gateway(
        procs,
        [emu],
        env={
            "DFLASH_GATEWAY_LIMITS__MAX_CONNECTIONS": str(MAX_CONNECTIONS),
            "DFLASH_GATEWAY_TIMEOUTS__CLIENT_HEADER_S": "60",
        },
    )
    idle = [_connect(gw) for _ in range(MAX_CONNECTIONS)]  # idle, within the header deadline
    try:
        request = b"GET /livez HTTP/1.1\r\nHost: x\r\n\r\n"
        with _connect(gw) as sock:
            sock.sendall(request)
            status, headers, error = _answer(_read_all(sock))
        assert status == 503
        assert error["code"] == "service_unavailable"
        assert headers[b"retry-after"] == b"2"
        assert headers[b"connection"] == b"close"
        refused = httpx.get(gw.url + "/livez", timeout=5)  # an HTTP client reads it as such
        assert refused.status_code == 503
        assert error_of(refused)["code"] == "service_unavailable"
    finally:
        idle.pop().close()

    def served() -> bool:
        with _connect(gw) as sock:
            sock.sendall(b"GET /livez HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            return _read_all(sock).startswith(b"HTTP/1.1 200 ")

    poll(served)  # a freed slot is usable again
    for sock in idle:
        sock.close()
    assert _requests_total(gw, route="other", status="503") >= 1
