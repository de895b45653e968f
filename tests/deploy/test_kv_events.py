"""KV events as rendered: one value makes every worker publish (--kv-events-config, SGLang's or
vLLM's form) on a named port only the gateway may reach, and every gateway replica subscribe at
that port and topic (loaded here by the gateway's own Settings)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.deploy.conftest import RELEASE, Manifests, container, pod_spec
from tests.deploy.test_tenants import _settings
from tests.deploy.test_workers import parse_flags, worker_flags

ON = ("--set", "workers.kvEvents.enabled=true")


def test_off_by_default(
    render: Callable[..., Manifests], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    m = render()
    assert "--kv-events-config" not in worker_flags(m)
    ports = [p["name"] for p in container(m.workers, "sglang")["ports"]]
    assert "kv-events" not in ports
    assert _settings(m, tmp_path, monkeypatch).kv_events.enabled is False


def test_one_value_wires_workers_gateway_and_policy(
    render: Callable[..., Manifests], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    m = render("default", *ON, "--set", "workers.kvEvents.port=6000")
    config = json.loads(worker_flags(m)["--kv-events-config"] or "")
    assert config == {"publisher": "zmq", "endpoint": "tcp://*:6000", "topic": "kv-events"}
    ports = {p["name"]: p["containerPort"] for p in container(m.workers, "sglang")["ports"]}
    assert ports["kv-events"] == 6000
    settings = _settings(m, tmp_path, monkeypatch).kv_events
    assert (settings.enabled, settings.port, settings.topic) == (True, 6000, "kv-events")
    assert settings.port_offset is None
    policy = m.one("NetworkPolicy", f"{RELEASE}-dflash-gateway-worker")
    rules = [r for r in policy["spec"]["ingress"] if r["ports"][0]["port"] == "kv-events"]
    [rule] = rules
    assert rule["from"] and all(
        f["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "gateway"
        for f in rule["from"]
    )


def test_vllm_workers_get_vllms_form(render: Callable[..., Manifests]) -> None:
    m = render("vllm-workers", *ON)
    args = container(m.workers, "vllm")["args"]
    config = json.loads(parse_flags(args[1:])["--kv-events-config"] or "")
    assert config["enable_kv_cache_events"] is True and config["endpoint"] == "tcp://*:5557"
    assert [c["name"] for c in pod_spec(m.workers)["containers"]] == ["vllm"]
