"""``serve --processes 2`` with the embedded default: two gateway processes on one port, two
emulated workers started once, and ``/metrics`` (whichever process answers) with the totals of
both processes."""

from __future__ import annotations

import asyncio
import os
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import orjson
from prometheus_client.mmap_dict import MmapedDict

from tests.support.procs import ProcessManager, children, serve_processes
from tests.support.tools import optional_tool

REQUESTS = 48
HELD = 16
REQUESTS_TOTAL = "dflash_gateway_requests_total"
IN_FLIGHT = "dflash_gateway_in_flight_requests"
ENV = {
    "DFLASH_GATEWAY_EMBEDDED__BASE_PORT": "0",
    "DFLASH_GATEWAY_EMBEDDED__SPEED": "50",
    "DFLASH_GATEWAY_HEALTH__INTERVAL_S": "0.3",
    "DFLASH_GATEWAY_DRAIN_ACCEPT_S": "0",
    "DFLASH_GATEWAY_DRAIN_S": "2",
    "DFLASH_GATEWAY_LOG_LEVEL": "warning",
}
# Above the gateway's own bound on its stop (each process: drain_accept_s + drain_s + 5 s, then
# each emulated worker: 5 s), so a stage that overstays is killed and named in the log, not the
# whole tree killed here. A healthy stop takes about a second.
STOP_GRACE_S = 30.0


def counter_file(pid: int) -> Path:
    """The process's own prometheus_client counter file (multiprocess mode)."""
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        target = Path(os.readlink(fd)) if fd.is_symlink() else None
        if target is not None and target.name == f"counter_{pid}.db":
            return target
    raise AssertionError(f"process {pid} has no counter file open")


def file_sum(path: Path, sample: str) -> float:
    """Sum of one sample's values in a prometheus_client multiprocess file."""
    return sum(
        value
        for key, value, _, _ in MmapedDict.read_all_values_from_file(str(path))  # type: ignore[no-untyped-call]
        if orjson.loads(key)[1] == sample
    )


async def traffic(url: str) -> int:
    """REQUESTS requests on fresh connections (half streamed); completion tokens seen."""

    async def one(i: int) -> int:
        body: dict[str, Any] = {
            "model": "kimi-k2.5",
            "max_tokens": 30 + i,
            "messages": [{"role": "user", "content": f"hello {i}"}],
        }
        if i % 2:
            body.update(stream=True, stream_options={"include_usage": True})
        async with httpx.AsyncClient(timeout=60) as client:  # a new connection each
            response = await client.post(url + "/v1/chat/completions", json=body)
        assert response.status_code == 200
        if not i % 2:
            return int(response.json()["usage"]["completion_tokens"])
        usage = [e for e in response.content.split(b"\n\n") if b'"usage":{' in e][-1]
        return int(orjson.loads(usage[6:])["usage"]["completion_tokens"])

    gate = asyncio.Semaphore(8)

    async def limited(i: int) -> int:
        async with gate:
            return await one(i)

    return sum(await asyncio.gather(*(limited(i) for i in range(REQUESTS))))


async def in_flight_while_held(url: str, files: dict[int, Path]) -> dict[str, Any]:
    async with httpx.AsyncClient(timeout=10) as control:
        workers = (await control.get(url + "/workers")).json()["workers"]
        for worker in workers:
            await control.post(worker["url"] + "/emulator/gate", json={"hold_after_chunks": 2})

    async def stream(i: int) -> None:
        body = {
            "model": "kimi-k2.5",
            "stream": True,
            "max_tokens": 50,
            "messages": [{"role": "user", "content": f"held {i}"}],
        }
        async with httpx.AsyncClient(timeout=60) as client:  # a new connection each
            response = await client.post(url + "/v1/chat/completions", json=body)
            assert response.status_code == 200

    tasks = [asyncio.create_task(stream(i)) for i in range(HELD)]
    seen: list[float] = []
    deadline = asyncio.get_running_loop().time() + 30
    # One keep-alive connection, like Prometheus: always the same process answers, and the
    # other one's count must reach it through its own file.
    async with httpx.AsyncClient(timeout=10) as scraper:
        while len(seen) < 3 and asyncio.get_running_loop().time() < deadline:
            total = sum(samples((await scraper.get(url + "/metrics")).text, IN_FLIGHT))
            seen = [*seen, total] if total == HELD else []
            await asyncio.sleep(0.3)
    per_process = {
        pid: file_sum(path.with_name(f"gauge_livesum_{pid}.db"), IN_FLIGHT)
        for pid, path in files.items()
    }
    async with httpx.AsyncClient(timeout=10) as control:
        for worker in workers:
            await control.post(worker["url"] + "/emulator/gate", json={"release": True})
    await asyncio.gather(*tasks)
    return {"metrics": seen, "files": per_process}


def settled(url: str) -> bool:
    """/metrics shows no request in flight within a few of the processes' 1 s refreshes."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if sum(samples(httpx.get(url + "/metrics", timeout=10).text, IN_FLIGHT)) == 0:
            return True
        time.sleep(0.2)
    return False


def samples(text: str, name: str) -> list[float]:
    return [
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name + "{") or line.startswith(name + " ")
    ]


def test_two_processes_export_the_totals_of_both(procs: ProcessManager) -> None:
    gw = serve_processes(procs, ENV)
    kids = children(gw.pid)
    serving = [pid for pid, cmd in kids.items() if " serve " in cmd]
    emulators = [pid for pid, cmd in kids.items() if " emulate " in cmd]
    assert len(serving) == 2 and len(emulators) == 2, kids  # the workers are started once
    files = {pid: counter_file(pid) for pid in serving}
    metrics_dir = next(iter(files.values())).parent
    assert {f.parent for f in files.values()} == {metrics_dir}

    seen = asyncio.run(traffic(gw.url))

    per_process = {pid: file_sum(path, REQUESTS_TOTAL) for pid, path in files.items()}
    assert all(count > 0 for count in per_process.values()), per_process  # both served
    # Each process refreshes its in-flight gauges in its file once a second: the answering
    # process may read the other's from just before its last requests ended.
    assert settled(gw.url), "in-flight gauges never returned to 0"
    for _ in range(4):  # any process answers /metrics with the same merged totals
        text = httpx.get(gw.url + "/metrics", timeout=10).text
        requests = samples(text, "dflash_gateway_requests_total")
        assert sum(requests) == REQUESTS == sum(per_process.values())
        assert sum(samples(text, "dflash_gateway_completion_tokens_total")) == seen
        assert sum(samples(text, "dflash_gateway_spec_accept_length_count")) == REQUESTS
        assert sum(samples(text, "dflash_gateway_in_flight_requests")) == 0
        assert samples(text, "dflash_gateway_worker_up") == [1.0, 1.0]
        assert len(samples(text, "dflash_gateway_queue_depth")) == 1
    promtool = optional_tool("promtool")
    if promtool is not None:  # the merged exposition is as clean as a single process's
        done = subprocess.run(
            [promtool, "check", "metrics"], input=text, capture_output=True, text=True
        )
        assert done.returncode == 0 and not (done.stdout + done.stderr).strip(), done.stdout

    # Streams held mid-way on the workers: in flight in both processes, and /metrics (one
    # process answering) adds up both processes' current counts.
    held = asyncio.run(in_flight_while_held(gw.url, files))
    assert held["metrics"] == [HELD] * 3, held
    assert all(count > 0 for count in held["files"].values()), held
    assert gw.stop(timeout=STOP_GRACE_S) == 0
    assert "still running" not in gw.logs(), gw.logs()[-3000:]  # no process overstayed its stop
    assert not metrics_dir.exists()
    assert all(not Path(f"/proc/{pid}").exists() for pid in [*serving, *emulators])
