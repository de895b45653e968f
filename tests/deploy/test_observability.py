"""Dashboard and rules: one source of truth in the chart's files/, copies kept identical, the
chart's ConfigMap and PrometheusRule equal to the files, and the files valid for Grafana and
Prometheus."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy.conftest import CHART, ROOT, Manifests, container

DASHBOARD = CHART / "files" / "dflash-gateway.json"
RULES = CHART / "files" / "rules.yaml"
COPIES = [
    (DASHBOARD, ROOT / "deploy" / "grafana" / "dflash-gateway.json"),
    (RULES, ROOT / "deploy" / "prometheus" / "rules.yaml"),
]


@pytest.mark.parametrize(("canonical", "copy"), COPIES, ids=lambda p: str(p.relative_to(ROOT)))
def test_copies_are_identical(canonical: Path, copy: Path) -> None:
    assert copy.read_bytes() == canonical.read_bytes(), (
        f"{copy.relative_to(ROOT)} differs from {canonical.relative_to(ROOT)}: edit the chart's "
        f"file, then: cp {canonical.relative_to(ROOT)} {copy.relative_to(ROOT)}"
    )


def test_dashboard_configmap_equals_the_canonical_file(render: Callable[..., Manifests]) -> None:
    cm = render().one("ConfigMap", "ci-dflash-gateway-dashboard")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["data"]["dflash-gateway.json"] == DASHBOARD.read_text().rstrip("\n")
    assert json.loads(cm["data"]["dflash-gateway.json"]) == json.loads(DASHBOARD.read_text())


@pytest.mark.parametrize("value_set", ["four-workers-custom", "ingress-hpa-netpol"])
def test_prometheus_rule_equals_the_canonical_file(
    render: Callable[..., Manifests], value_set: str
) -> None:
    rule = render(value_set).one("PrometheusRule")
    assert rule["spec"] == yaml.safe_load(RULES.read_text())


def test_monitoring_objects_are_opt_in(render: Callable[..., Manifests]) -> None:
    m = render()
    assert m.all("ServiceMonitor") == [] and m.all("PrometheusRule") == []


def test_service_monitors_scrape_gateway_and_workers(render: Callable[..., Manifests]) -> None:
    m = render("four-workers-custom")
    monitors = {s["metadata"]["name"]: s for s in m.all("ServiceMonitor")}
    for name, svc_name in [
        # The gateway's metrics port, scraped without a key (the API port's /metrics needs one
        # when client keys are configured).
        ("ci-dflash-gateway", "ci-dflash-gateway-metrics"),
        ("ci-dflash-gateway-worker", "ci-dflash-gateway-worker"),
    ]:
        mon = monitors[name]["spec"]
        assert monitors[name]["metadata"]["labels"]["release"] == "kube-prometheus-stack"
        svc = m.one("Service", svc_name)
        selector = mon["selector"]["matchLabels"]
        selected = [
            s["metadata"]["name"]
            for s in m.all("Service")
            if all(s["metadata"]["labels"].get(k) == v for k, v in selector.items())
        ]
        assert selected == [svc_name]
        [endpoint] = mon["endpoints"]
        assert endpoint["path"] == "/metrics"
        assert endpoint["port"] in [p["name"] for p in svc["spec"]["ports"]]
        assert mon["namespaceSelector"] == {"matchNames": ["dflash"]}
    metrics_svc = m.one("Service", "ci-dflash-gateway-metrics")
    assert metrics_svc["spec"]["type"] == "ClusterIP"  # never on the public Service
    [port] = metrics_svc["spec"]["ports"]
    assert (port["name"], port["port"], port["targetPort"]) == ("metrics", 9100, "metrics")
    assert m.gateway_settings()["metrics_port"] == 9100
    ports = {p["name"]: p["containerPort"] for p in container(m.gateway, "gateway")["ports"]}
    assert ports == {"http": 8000, "metrics": 9100}
    public = m.one("Service", "ci-dflash-gateway")
    assert [p["name"] for p in public["spec"]["ports"]] == ["http"]


def _exprs(node: Any) -> list[str]:
    if isinstance(node, dict):
        found = [node["expr"]] if isinstance(node.get("expr"), str) and node["expr"] else []
        return found + [e for v in node.values() for e in _exprs(v)]
    if isinstance(node, list):
        return [e for v in node for e in _exprs(v)]
    return []


def test_dashboard_is_a_grafana_dashboard() -> None:
    board = json.loads(DASHBOARD.read_text())
    assert board["uid"] == "dflash-gateway"
    assert board["title"]
    assert board["panels"]
    exprs = _exprs(board)
    assert exprs
    assert any("dflash_gateway_requests_total" in e for e in exprs)
    # Panels use the dashboard's datasource variable, so it works with any Prometheus uid.
    for panel in board["panels"]:
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${datasource}"


def test_rules_file_passes_promtool(promtool: str) -> None:
    done = subprocess.run(
        [promtool, "check", "rules", str(RULES)], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_dashboard_queries_parse(promtool: str, tmp_path: Path) -> None:
    """Every panel query is valid PromQL (checked by promtool as recording rules)."""
    exprs = _exprs(json.loads(DASHBOARD.read_text()))
    rules = {
        "groups": [
            {
                "name": "dashboard",
                "rules": [
                    {"record": f"dashboard:expr{i}", "expr": e.replace("$__rate_interval", "5m")}
                    for i, e in enumerate(exprs)
                ],
            }
        ]
    }
    path = tmp_path / "dashboard-exprs.yaml"
    path.write_text(yaml.safe_dump(rules))
    done = subprocess.run(
        [promtool, "check", "rules", str(path)], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize("config", ["deploy/prometheus/prometheus.yml", "docker/prometheus.yml"])
def test_prometheus_configs_pass_promtool(config: str, promtool: str, tmp_path: Path) -> None:
    data = yaml.safe_load((ROOT / config).read_text())
    # Rule files resolve like Prometheus would see them (docker/: the compose mount target).
    data["rule_files"] = [str(RULES)]
    path = tmp_path / "prometheus.yml"
    path.write_text(yaml.safe_dump(data))
    done = subprocess.run(
        [promtool, "check", "config", str(path)], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_local_prometheus_scrapes_gateway_and_emulators() -> None:
    data = yaml.safe_load((ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())
    targets = {
        t for job in data["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]
    }
    assert targets == {"127.0.0.1:8000", "127.0.0.1:30000", "127.0.0.1:30001"}
    assert data["rule_files"] == ["rules.yaml"]
    assert (ROOT / "deploy" / "prometheus" / "rules.yaml").exists()
