"""``metrics_port``: /metrics on its own port only, for one process and for several."""

from __future__ import annotations

import contextlib
import signal
import socket

import httpx
import pytest

from tests.support.procs import PYTHON, ProcessManager, free_port


@pytest.mark.parametrize("processes", [1, 2])
def test_metrics_move_to_their_own_port(procs: ProcessManager, processes: int) -> None:
    emulator = procs.start(
        [PYTHON, "-m", "app", "emulate", "--port", "{port}", "--speed", "50"], name="emulator"
    )
    metrics_port = free_port()
    gateway = procs.start(
        [
            PYTHON,
            "-m",
            "app",
            "serve",
            "--port",
            "{port}",
            "--worker-url",
            emulator.url,
            "--processes",
            str(processes),
        ],
        name="gateway",
        ready_path="/readyz",
        ready_status=200,
        env={
            "DFLASH_GATEWAY_METRICS_PORT": str(metrics_port),
            "DFLASH_GATEWAY_DRAIN_ACCEPT_S": "0",
        },
    )
    chat = {"model": "kimi-k2.5", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    assert (
        httpx.post(gateway.url + "/v1/chat/completions", json=chat, timeout=30).status_code == 200
    )

    on_api_port = httpx.get(gateway.url + "/metrics", timeout=10)
    assert on_api_port.status_code == 404
    assert set(on_api_port.json()["error"]) == {"message", "type", "param", "code"}

    scraped = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10)
    assert scraped.status_code == 200
    assert 'dflash_gateway_requests_total{model="moonshotai/Kimi-K2.5"' in scraped.text
    assert httpx.get(f"http://127.0.0.1:{metrics_port}/v1/models", timeout=10).status_code == 404

    gateway.signal(signal.SIGTERM)  # the drain stops the metrics server with the gateway
    assert gateway.popen is not None
    assert gateway.popen.wait(timeout=30) == 0
    with pytest.raises(httpx.TransportError):
        httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=2)


OPS_KEY = "sk-ops-0a1b2c3d4e5f60718293"


def _raw(host: str, port: int, data: bytes) -> bytes:
    """Send ``data`` and read until the server closes the connection."""
    with socket.create_connection((host, port), timeout=15) as sock:
        sock.sendall(data)
        parts = []
        with contextlib.suppress(ConnectionResetError):
            while chunk := sock.recv(65536):
                parts.append(chunk)
    return b"".join(parts)


def test_metrics_port_has_the_api_ports_guards_and_its_own_host(procs: ProcessManager) -> None:
    emulator = procs.start(
        [PYTHON, "-m", "app", "emulate", "--port", "{port}", "--speed", "50"], name="emulator"
    )
    metrics_port = free_port()
    procs.start(
        [PYTHON, "-m", "app", "serve", "--port", "{port}", "--worker-url", emulator.url],
        name="gateway",
        ready_path="/readyz",
        ready_status=200,
        env={
            "DFLASH_GATEWAY_METRICS_PORT": str(metrics_port),
            "DFLASH_GATEWAY_METRICS_HOST": "127.0.0.2",  # another loopback address
            "DFLASH_GATEWAY_API_KEYS": f"ops:{OPS_KEY}",
            "DFLASH_GATEWAY_AUTH__PROTECT_OPS": "true",
            "DFLASH_GATEWAY_LIMITS__MAX_HEADER_BYTES": "4096",
            "DFLASH_GATEWAY_TIMEOUTS__CLIENT_HEADER_S": "1",
            "DFLASH_GATEWAY_DRAIN_ACCEPT_S": "0",
        },
    )
    url = f"http://127.0.0.2:{metrics_port}/metrics"
    with pytest.raises(httpx.ConnectError):  # bound to metrics_host only
        httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5)

    # auth.protect_ops: a key, exactly one, like /metrics on the API port.
    anonymous = httpx.get(url, timeout=10)
    assert anonymous.status_code == 401
    assert anonymous.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(url, headers={"authorization": "Bearer sk-wrong"}).status_code == 401
    scraped = httpx.get(url, headers={"authorization": f"Bearer {OPS_KEY}"}, timeout=10)
    assert scraped.status_code == 200
    assert "dflash_gateway_requests_total" in scraped.text
    twice = _raw(
        "127.0.0.2",
        metrics_port,
        b"GET /metrics HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer %s\r\n"
        b"Authorization: Bearer %s\r\nConnection: close\r\n\r\n" % (OPS_KEY.encode(), b"x"),
    )
    assert twice.startswith(b"HTTP/1.1 400 ")

    # Header size cap, counted as bytes arrive, and the header deadline.
    endless = _raw("127.0.0.2", metrics_port, b"GET /metrics HTTP/1.1\r\nX-Big: " + b"a" * 8192)
    assert endless.startswith(b"HTTP/1.1 431 ")
    stalled = _raw("127.0.0.2", metrics_port, b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
    assert stalled.startswith(b"HTTP/1.1 408 ")
    assert b'"code":"request_timeout"' in stalled
