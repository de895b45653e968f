"""What ``app/metrics/prom_adapter.py`` (and tests/metrics/test_processes.py, which reads the
multiprocess files) relies on in prometheus_client, beyond its public API.

A failure here names the internal that changed in a new prometheus-client release: adapt the
adapter, then add the release to ``TESTED_VERSIONS`` and widen the pin in pyproject.toml.
"""

from __future__ import annotations

import importlib.metadata
import itertools
import json
import math
import os
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest, values
from prometheus_client.metrics_core import GaugeMetricFamily, Metric
from prometheus_client.mmap_dict import MmapedDict

from app.metrics.prom_adapter import TESTED_VERSIONS, CurrentWorkers, observe_gaps

ROOT = Path(__file__).resolve().parents[2]
ADAPTER = "app/metrics/prom_adapter.py"


def test_installed_release_is_one_the_adapter_was_checked_on() -> None:
    version = importlib.metadata.version("prometheus-client")
    minor = ".".join(version.split(".")[:2])
    assert minor in TESTED_VERSIONS, (
        f"prometheus-client {version} is not among the releases {ADAPTER} was checked on "
        f"({', '.join(TESTED_VERSIONS)}): run this file on it, then extend TESTED_VERSIONS"
    )
    major, last = TESTED_VERSIONS[-1].split(".")
    pin = f"prometheus-client>={TESTED_VERSIONS[0]},<{major}.{int(last) + 1}"
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert pin in deps, f"pyproject.toml must pin {pin!r} (the releases checked), has {deps}"


def _multiprocess_mode(env: dict[str, str]) -> str:
    code = "from app.metrics.prom_adapter import multiprocess_mode; print(multiprocess_mode())"
    environ = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env={**environ, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


@pytest.mark.processes
def test_multiprocess_mode_is_read_from_the_value_class(tmp_path: Path) -> None:
    assert hasattr(values.ValueClass, "_multiprocess"), (
        "prometheus_client.values.ValueClass has no _multiprocess flag any more: "
        "multiprocess_mode() would report single-process mode even with PROMETHEUS_MULTIPROC_DIR"
    )
    assert _multiprocess_mode({}) == "False"
    assert _multiprocess_mode({"PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}) == "True", (
        "values.ValueClass._multiprocess is not True in multiprocess mode any more"
    )


def test_histogram_child_layout_and_bulk_observation() -> None:
    buckets = (0.01, 0.1, 1.0)
    one, bulk = CollectorRegistry(), CollectorRegistry()
    h1 = Histogram("gap_seconds", "d", ["m"], buckets=buckets, registry=one).labels("x")
    h2 = Histogram("gap_seconds", "d", ["m"], buckets=buckets, registry=bulk).labels("x")
    assert getattr(h2, "_upper_bounds", None) == [*buckets, math.inf], (
        "Histogram children no longer keep their bounds, +Inf last, in ._upper_bounds"
    )
    layout = getattr(h2, "_buckets", None)
    assert isinstance(layout, list) and len(layout) == len(buckets) + 1, (
        "Histogram children no longer keep one (non-cumulative) value per bound in ._buckets"
    )
    assert all(hasattr(b, "inc") for b in layout), "._buckets values have no .inc()"
    assert hasattr(getattr(h2, "_sum", None), "inc"), "Histogram children have no ._sum.inc()"
    times = [0.0, 0.005, 0.005, 0.05, 0.5, 5.0, 5.2]
    for a, b in itertools.pairwise(times):
        h1.observe(b - a)
    observe_gaps(h2, times[0], times[1:])
    assert _samples(bulk) == pytest.approx(_samples(one)), (
        "observe_gaps no longer equals one observe() per gap: the bucket layout changed"
    )


def _samples(registry: CollectorRegistry) -> dict[tuple[str, str], float]:
    return {
        (s.name, repr(sorted(s.labels.items()))): s.value
        for family in registry.collect()
        for s in family.samples
        if not s.name.endswith("_created")
    }


class _Gauges:
    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily("dflash_gateway_worker_up", "d", labels=["worker"])
        for worker in ("w1", "w2"):
            family.add_metric([worker], 1)
        yield family


def test_worker_gauges_of_departed_workers_are_filtered_from_collected_samples() -> None:
    registry = CollectorRegistry()
    registry.register(CurrentWorkers(_Gauges(), frozenset({"dflash_gateway_worker_up"}), {"w1"}))
    text = generate_latest(registry).decode()
    assert 'dflash_gateway_worker_up{worker="w1"} 1.0' in text
    assert "w2" not in text, "Metric.samples of a collected family can no longer be replaced"


MULTIPROCESS_RENDER = """
from dataclasses import dataclass, field
from app.metrics import Metrics

@dataclass
class Load:
    gen_throughput: float = 5.0
    accept_length: float | None = 3.0
    accept_rate: float | None = 0.5
    running: int = 0
    waiting: int = 0
    waiting_tokens: int = 0

@dataclass
class Breaker:
    state: int = 0

@dataclass
class Accept:
    ewma: float | None = 1.3
    collapsed: bool = True

@dataclass
class Worker:
    name: str
    models: tuple[str, ...] = ("kimi",)
    in_flight: int = 1
    up: bool = True
    load: Load = field(default_factory=Load)
    breaker: Breaker = field(default_factory=Breaker)
    accept: Accept = field(default_factory=Accept)
    engine_name: str = "sglang"
    role: str = "whole"

metrics = Metrics(models=["kimi"])
assert metrics.multiprocess
metrics.record_request("/v1/chat/completions", "kimi", 200, 0.5)
metrics.observe_pool([Worker("w1"), Worker("w2")], 0)
metrics.observe_pool([Worker("w1")], 0)
print(metrics.render().decode())
"""


@pytest.mark.processes
def test_multiprocess_exposition_merges_files_and_drops_departed_workers(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", MULTIPROCESS_RENDER],
        cwd=ROOT,
        env={**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    text = done.stdout
    assert (
        'dflash_gateway_requests_total{model="kimi",route="/v1/chat/completions",status="200"} 1.0'
        in text
    ), "MultiProcessCollector no longer merges the processes' counter files"
    assert 'dflash_gateway_worker_up{role="whole",worker="w1"} 1.0' in text
    assert 'worker="w2"' not in text.split("dflash_gateway_worker_up", 1)[1].split("# HELP")[0]
    assert 'dflash_gateway_worker_accept_collapsed{role="whole",worker="w1"} 1.0' in text
    collapsed = text.split("dflash_gateway_worker_accept_collapsed", 1)[1].split("# HELP")[0]
    assert 'worker="w2"' not in collapsed
    # tests/metrics/test_processes.py reads a process's counter file directly.
    [counters] = tmp_path.glob("counter_*.db")
    entries = MmapedDict.read_all_values_from_file(str(counters))  # type: ignore[no-untyped-call]
    requests = [
        v for key, v, *_ in entries if json.loads(key)[1] == "dflash_gateway_requests_total"
    ]
    assert 1.0 in requests, (
        "MmapedDict.read_all_values_from_file no longer yields (json key, value, ...) entries"
    )
