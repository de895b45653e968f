"""``serve --processes 2`` (embedded default) stopped by a signal to its process group, as a
terminal's Ctrl-C or ``kill`` sends it: the parent passes Ctrl-C on as Ctrl-C (every process
stops at once, as a single process does) and SIGTERM as SIGTERM (the drain: not ready, still
serving, until a second signal)."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import httpx

from tests.support.procs import ManagedProcess, ProcessManager, children, serve_processes

ENV = {
    "DFLASH_GATEWAY_EMBEDDED__BASE_PORT": "0",
    "DFLASH_GATEWAY_EMBEDDED__SPEED": "50",
    # A drain window far longer than the stop grace: a stop that waits for it is killed.
    "DFLASH_GATEWAY_DRAIN_ACCEPT_S": "600",
    "DFLASH_GATEWAY_DRAIN_S": "2",
}
CHAT = {"model": "kimi-k2.5", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}


def start(procs: ProcessManager) -> tuple[ManagedProcess, list[int]]:
    gw = serve_processes(procs, ENV)
    kids = list(children(gw.pid))
    assert len(kids) == 4, kids  # two gateway processes, two emulated workers
    return gw, kids


def stopped_cleanly(gw: ManagedProcess, kids: list[int]) -> None:
    """Nothing was killed for overstaying, and no process of the tree is left."""
    assert "still running" not in gw.logs(), gw.logs()[-3000:]
    assert all(not Path(f"/proc/{pid}").exists() for pid in kids)


def test_ctrl_c_stops_every_process_without_the_drain_window(procs: ProcessManager) -> None:
    gw, kids = start(procs)
    assert httpx.post(gw.url + "/v1/chat/completions", json=CHAT, timeout=30).status_code == 200
    assert gw.stop() == 0  # SIGINT to the group; SIGKILL (-9) if still running after 10 s
    stopped_cleanly(gw, kids)


def test_sigterm_drains_until_a_second_signal(procs: ProcessManager) -> None:
    gw, kids = start(procs)
    gw.signal(signal.SIGTERM)
    deadline = time.monotonic() + 30
    ready = [200]
    while time.monotonic() < deadline and ready != [503] * 4:  # every process: not ready
        ready = [*ready, httpx.get(gw.url + "/readyz", timeout=10).status_code][-4:]
        time.sleep(0.05)
    assert ready == [503] * 4
    # Still serving in the accept window: the load balancer may not know yet.
    assert httpx.post(gw.url + "/v1/chat/completions", json=CHAT, timeout=30).status_code == 200
    assert gw.alive()
    assert gw.stop() == 0  # the second signal ends the drain at once
    stopped_cleanly(gw, kids)
