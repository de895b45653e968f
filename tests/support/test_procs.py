from __future__ import annotations

import httpx
import pytest

from tests.support.procs import PYTHON, ProcessManager, ProcessStartError


def test_starts_on_a_free_port_and_captures_logs(procs: ProcessManager) -> None:
    server = procs.start(
        [PYTHON, "-m", "http.server", "{port}", "--bind", "127.0.0.1"], name="http", ready_path="/"
    )
    assert httpx.get(server.url + "/").status_code == 200
    assert "GET / HTTP" in server.logs()


def test_stop_terminates_and_restart_reuses_the_port(procs: ProcessManager) -> None:
    server = procs.start(
        [PYTHON, "-m", "http.server", "{port}", "--bind", "127.0.0.1"], name="http", ready_path="/"
    )
    port = server.port
    server.kill()
    assert not server.alive()
    with pytest.raises(httpx.TransportError):
        httpx.get(server.url + "/", timeout=1)
    procs.restart(server, ready_path="/")
    assert server.port == port and httpx.get(server.url + "/").status_code == 200


def test_early_exit_reports_the_output(procs: ProcessManager) -> None:
    with pytest.raises(ProcessStartError, match="boom-marker"):
        procs.start(
            [PYTHON, "-c", "import sys; print('boom-marker'); sys.exit(3)"],
            name="crasher",
            ready_path="/",
            timeout=10,
        )


@pytest.mark.processes
def test_stop_all_leaves_nothing_running(tmp_path) -> None:  # type: ignore[no-untyped-def]
    manager = ProcessManager(tmp_path)
    proc = manager.start([PYTHON, "-c", "import time; time.sleep(600)"], ready_path=None)
    manager.stop_all()
    assert not proc.alive()
