"""``metrics_port``: /metrics on its own port only, for one process and for several."""

from __future__ import annotations

import signal

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
