"""A real Prometheus on loopback, scraping the given targets every second, queried over its API."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import httpx
import yaml

from loadtest.processes import ManagedProcess, ProcessManager
from tests.support.tools import require_tool


class Prometheus:
    def __init__(self, proc: ManagedProcess) -> None:
        self.proc = proc
        self.url = proc.url

    def query(self, expr: str) -> list[dict[str, Any]]:
        response = httpx.get(self.url + "/api/v1/query", params={"query": expr}, timeout=10)
        body = response.json()
        if body.get("status") != "success":
            raise AssertionError(f"query {expr!r} failed: {body.get('error')}")
        return list(body["data"]["result"])

    def wait_for(self, expr: str, timeout: float = 30.0) -> list[dict[str, Any]]:
        """Poll until ``expr`` returns at least one series."""
        deadline = time.monotonic() + timeout
        while True:
            result = self.query(expr)
            if result or time.monotonic() > deadline:
                return result
            time.sleep(0.5)

    def targets_up(self) -> dict[str, str]:
        data = httpx.get(self.url + "/api/v1/targets", timeout=10).json()["data"]
        return {t["scrapeUrl"]: t["health"] for t in data["activeTargets"]}


def start_prometheus(
    procs: ProcessManager,
    jobs: dict[str, Sequence[str]],
    *,
    rule_files: Sequence[str] = (),
) -> Prometheus:
    """``jobs`` maps a job name to ``host:port`` targets."""
    binary = require_tool("prometheus")
    workdir = procs.log_dir / "prometheus"
    workdir.mkdir(exist_ok=True)
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": list(rule_files),
        "scrape_configs": [
            {"job_name": job, "static_configs": [{"targets": list(targets)}]}
            for job, targets in jobs.items()
        ],
    }
    (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
    proc = procs.start(
        [
            binary,
            f"--config.file={workdir / 'prometheus.yml'}",
            "--web.listen-address=127.0.0.1:{port}",
            f"--storage.tsdb.path={workdir / 'data'}",
            "--log.level=warn",
        ],
        name="prometheus",
        ready_path="/-/ready",
        ready_status=200,
    )
    return Prometheus(proc)
