"""The benchmarks end to end, tiny: real emulator and gateway processes on loopback."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from loadtest import overhead
from tests.support.procs import PYTHON, ManagedProcess, ProcessManager


@pytest.fixture
def gateway(procs: ProcessManager) -> ManagedProcess:
    emulator = procs.start(
        [PYTHON, "-m", "app", "emulate", "--port", "{port}", "--speed", "100"], name="emulator"
    )
    return procs.start(
        [PYTHON, "-m", "app", "serve", "--port", "{port}", "--worker-url", emulator.url],
        name="gateway",
        ready_path="/readyz",
        ready_status=200,
    )


def _bench(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [PYTHON, "-m", "loadtest", *args], capture_output=True, text=True, timeout=300
    )


def test_seed_bench_prints_the_table_and_writes_json_and_png(
    gateway: ManagedProcess, tmp_path: Path
) -> None:
    # A tiny GSM8K-shaped file: the test must not depend on ../shared/datasets being there.
    (tmp_path / "gsm8k").mkdir()
    (tmp_path / "gsm8k" / "test.jsonl").write_text(
        "".join(json.dumps({"question": f"What is {i} + {i}?"}) + "\n" for i in range(5))
    )
    result = _bench(
        "seed",
        "--base-url",
        gateway.url,
        "--datasets",
        "gsm8k,mbpp",
        "--datasets-dir",
        str(tmp_path),
        "--num-prompts",
        "12",
        "--concurrency",
        "4",
        "--max-tokens",
        "64",
        "--mbpp-path",
        str(tmp_path / "absent.jsonl"),
        "--out",
        str(tmp_path),
    )
    assert result.returncode == 0, result.stderr  # a missing dataset is reported, not fatal
    rows: dict[str, str] = {}
    for line in result.stdout.splitlines():  # the seed table comes first, then latencies
        if line.strip():
            rows.setdefault(line.split()[0], line)
    assert "exact" in rows["gsm8k"]
    assert "missing" in rows["mbpp"]
    assert "--mbpp-path" in rows["mbpp"]
    data = json.loads((tmp_path / "seed.json").read_text())
    gsm8k = data["datasets"][0]
    assert gsm8k["requests"] == 8  # 12 prompts minus a warm-up of C=4
    assert gsm8k["failed"] == 0
    assert 1.0 <= gsm8k["accept_length"] <= 8.0
    assert (tmp_path / "seed.png").stat().st_size > 1000


def test_seed_bench_streaming_estimates_acceptance(gateway: ManagedProcess, tmp_path: Path) -> None:
    result = _bench(
        "seed",
        "--base-url",
        gateway.url,
        "--datasets",
        "mtbench",
        "--stream",
        "--num-prompts",
        "6",
        "--concurrency",
        "2",
        "--max-tokens",
        "64",
        "--out",
        str(tmp_path),
    )
    assert result.returncode == 0, result.stdout + result.stderr
    row = next(line for line in result.stdout.splitlines() if line.startswith("mtbench"))
    assert "estimated" in row
    assert "TTFT" in result.stdout


def test_overhead_bench_runs_direct_and_through_the_gateway(tmp_path: Path) -> None:
    result = _bench(
        "overhead",
        "--skip-router",
        "--requests",
        "16",
        "--paced-requests",
        "8",
        "--concurrency",
        "4",
        "--fanin-concurrency",
        "8",
        "--fanin-requests",
        "8",
        "--max-tokens",
        "32",
        "--out",
        str(tmp_path),
    )
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    for scenario in overhead.SCENARIOS:
        targets = {line.split()[1] for line in lines if line.split()[:1] == [scenario]}
        streamed = scenario.startswith("stream")
        surfaces = {"gateway-messages", "gateway-responses"} if streamed else set()
        assert targets == {"direct", "dflash-gateway", "gateway-1pool", "gateway-pd", *surfaces}
        for path in ("/v1/messages", "/v1/responses"):
            ratio = [line for line in lines if line.startswith(f"{scenario}: {path} CPU")]
            assert len(ratio) == (1 if streamed else 0)
        pd = [line for line in lines if line.startswith(f"{scenario}: PD disaggregation CPU")]
        assert len(pd) == 1
    data = json.loads((tmp_path / "overhead.json").read_text())
    assert all(m["failed"] == 0 for m in data)
    assert all(m["cpu_s_per_1000"] is not None for m in data if m["target"] != "direct")


def test_overhead_bench_sums_each_targets_interleaved_rounds(tmp_path: Path) -> None:
    result = _bench(
        "overhead",
        "--skip-router",
        "--skip-pd",
        "--scenarios",
        "stream_saturation",
        "--requests",
        "12",
        "--concurrency",
        "3",
        "--max-tokens",
        "16",
        "--rounds",
        "3",
        "--out",
        str(tmp_path),
    )
    assert result.returncode == 0, result.stdout + result.stderr
    data = json.loads((tmp_path / "overhead.json").read_text())
    targets = [m["target"] for m in data]
    assert targets == ["direct", "dflash-gateway", "gateway-messages", "gateway-responses"]
    assert all(m["ok"] == 36 and m["failed"] == 0 for m in data)
    assert any("/v1/messages CPU per chunk" in line for line in result.stdout.splitlines())


def test_overhead_ab_bench_measures_each_checkout_in_interleaved_blocks() -> None:
    result = _bench(
        "overhead-ab",
        "--trees",
        ".,.:1",
        "--floor",
        "--scenario",
        "stream_saturation",
        "--block",
        "8",
        "--blocks",
        "2",
        "--concurrency",
        "4",
        "--max-tokens",
        "32",
    )
    assert result.returncode == 0, result.stdout + result.stderr
    rows = [line.split() for line in result.stdout.splitlines() if line.startswith(".")]
    assert len(rows) == 2  # one line per proxy: CPU, median, failures, TTFT, two blocks
    assert all(row[3] == "0" and len(row) == 7 for row in rows)
    floors = [line.split() for line in result.stdout.splitlines() if line.startswith("floor-")]
    assert sorted(row[0] for row in floors) == ["floor-asgi", "floor-protocol"]
    assert all(row[3] == "0" for row in floors)  # every request relayed
    assert "stream_saturation: proxy CPU seconds per 1,000 relayed chunks" in result.stdout


def test_overhead_ab_bench_measures_gateways_writing_their_access_log() -> None:
    result = _bench(
        "overhead-ab",
        "--trees",
        ".",
        "--scenario",
        "non_stream_logged",
        "--block",
        "8",
        "--blocks",
        "2",
        "--concurrency",
        "4",
        "--max-tokens",
        "32",
    )
    assert result.returncode == 0, result.stdout + result.stderr
    (row,) = [line.split() for line in result.stdout.splitlines() if line.startswith(".")]
    assert row[3] == "0" and len(row) == 7
    assert "non_stream_logged: proxy CPU seconds per 1,000 requests" in result.stdout


def test_routing_bench_runs_each_policy_on_a_fleet_and_writes_json_and_png(
    tmp_path: Path,
) -> None:
    (tmp_path / "gsm8k").mkdir()
    (tmp_path / "gsm8k" / "test.jsonl").write_text(
        "".join(json.dumps({"question": f"What is {i} + {i}?"}) + "\n" for i in range(5))
    )
    result = _bench(
        "routing",
        "--policies",
        "least_inflight,spare_capacity",
        "--fleets",
        "heterogeneous",
        "--datasets-dir",
        str(tmp_path),
        "--num-prompts",
        "16",
        "--concurrency",
        "4",
        "--max-tokens",
        "16",
        "--speed",
        "50",
        "--out",
        str(tmp_path),
    )
    assert result.returncode == 0, result.stderr
    assert "spare_capacity vs least_inflight" in result.stdout
    data = json.loads((tmp_path / "routing.json").read_text())
    runs = {run["policy"]: run for run in data["runs"]}
    assert set(runs) == {"least_inflight", "spare_capacity"}
    for run in runs.values():
        assert run["fleet"] == "heterogeneous" and run["failed"] == 0
        assert run["completed"] == 12  # 16 less the 4 warm-up requests
        assert sum(run["requests_per_worker"]) == 16
    assert (tmp_path / "routing.png").stat().st_size > 0


def test_fairness_bench_prints_every_tenant_row_and_writes_json(tmp_path: Path) -> None:
    # Streams long enough (--speed 2: ~0.1 s each) that A's 12 on 4 slots really queue, whatever
    # the machine's scheduling jitter; at high speed they end before the flood can form.
    result = _bench(
        "fairness",
        *("--a-streams", "12", "--slots", "4", "--duration", "2", "--baseline-requests", "4"),
        *("--max-tokens", "16", "--speed", "2", "--out", str(tmp_path)),
    )
    assert result.returncode == 0, result.stdout + result.stderr
    for row in ("A (flood)", "B (under flood)", "B alone", "queue wait p50", "TTFT p50"):
        assert row in result.stdout
    report = json.loads((tmp_path / "fairness.json").read_text())
    rows = {r["tenant"]: r for r in report["rows"]}
    assert rows["B alone"]["requests"] == 4
    assert rows["A (flood)"]["requests"] > 0 and rows["B (under flood)"]["requests"] > 0
    assert rows["A (flood)"]["queue_wait_p50_ms"] > 0  # A queued behind its own flood
    assert set(report["goals"]) >= {"b_ttft_ratio", "slots_busy_share", "one_slot_free_ms"}
