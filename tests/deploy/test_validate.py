"""Rendered manifests against Kubernetes' own schemas (kubernetes-validate --strict, pinned
version), the Prometheus Operator objects against deploy/k8s/crd-schemas/, and checkov over the
rendered chart (every value set) and the Dockerfile: no failed check, every suppression
explained."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.deploy.conftest import KUBE_VERSION, ROOT, TOOLS, VALUE_SETS, Manifests, run


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_kubernetes_validate_strict(
    tools: Path, rendered_files: dict[str, Path], value_set: str
) -> None:
    done = run(
        [tools / "kubernetes-validate", "--strict", "-k", KUBE_VERSION, rendered_files[value_set]]
    )
    assert done.returncode == 0, done.stdout + done.stderr
    # Only the Prometheus Operator and KEDA kinds may lack a built-in schema (checked below).
    for line in (done.stdout + done.stderr).splitlines():
        if "Couldn't find schema" in line:
            assert re.search(
                r"kind (ServiceMonitor|PrometheusRule) with api version monitoring\.coreos\.com/v1"
                r"|kind ScaledObject with api version keda\.sh/v1alpha1",
                line,
            ), line


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_custom_resources_match_their_schemas(
    tools: Path, rendered_files: dict[str, Path], value_set: str
) -> None:
    done = run([tools / "python", TOOLS / "validate_crds.py", rendered_files[value_set]])
    assert done.returncode == 0, done.stdout + done.stderr


def test_crd_schemas_reject_bad_shapes(tools: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "apiVersion: monitoring.coreos.com/v1\nkind: ServiceMonitor\n"
        "metadata: {name: x, namespace: y}\n"
        "spec: {selector: {matchLabels: {a: b}}, endpoints: [{port: http, intervall: 15s}]}\n"
        "---\napiVersion: monitoring.coreos.com/v1\nkind: PrometheusRule\n"
        "metadata: {name: x, namespace: y}\n"
        "spec: {groups: [{name: g, rules: [{record: 'bad name', expr: up}]}]}\n"
        "---\napiVersion: example.com/v1\nkind: Unknown\nmetadata: {name: x, namespace: y}\n"
        # KEDA wants every trigger metadata value as a string.
        "---\napiVersion: keda.sh/v1alpha1\nkind: ScaledObject\nmetadata: {name: x, namespace: y}\n"
        "spec: {scaleTargetRef: {name: w}, triggers: [{type: prometheus, "
        "metadata: {threshold: 0.8}}]}\n"
    )
    done = run([tools / "python", TOOLS / "validate_crds.py", bad])
    assert done.returncode == 1
    assert done.stdout.count("FAIL") == 4, done.stdout


def test_kubernetes_validate_catches_unknown_fields(tools: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "apiVersion: v1\nkind: Service\nmetadata: {name: x}\n"
        "spec: {bogus: 1, ports: [{port: 80}]}\n"
    )
    done = run([tools / "kubernetes-validate", "--strict", "-k", KUBE_VERSION, bad])
    assert done.returncode != 0


def _checkov(tools: Path, *args: str | Path) -> dict[str, Any]:
    done = run(
        [tools / "checkov", *args, "--skip-download", "--quiet", "--compact", "-o", "json"],
        timeout=600,
    )
    assert done.stdout, done.stderr
    data = json.loads(done.stdout)
    reports = data if isinstance(data, list) else [data]
    failed = [
        f"{c['check_id']} {c['resource']} ({c.get('file_path')})"
        for r in reports
        for c in r.get("results", {}).get("failed_checks", [])
    ]
    skipped = [c for r in reports for c in r.get("results", {}).get("skipped_checks", [])]
    passed = sum(r.get("summary", {}).get("passed", 0) for r in reports)
    return {"failed": failed, "skipped": skipped, "passed": passed, "rc": done.returncode}


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_checkov_chart(tools: Path, rendered_files: dict[str, Path], value_set: str) -> None:
    """checkov's Kubernetes checks over the chart as rendered for each value set (rendered here
    with a real namespace; checkov's own helm runner renders into "default" and would report
    only that)."""
    result = _checkov(tools, "-f", rendered_files[value_set], "--framework", "kubernetes")
    assert result["failed"] == [], result["failed"]
    assert result["passed"]
    skipped: list[dict[str, Any]] = result["skipped"]
    for skip in skipped:
        assert len(skip["check_result"].get("suppress_comment", "")) > 20, skip["check_id"]


def test_checkov_dockerfiles(tools: Path) -> None:
    result = _checkov(tools, "-d", ROOT / "docker", "--framework", "dockerfile")
    assert result["failed"] == [], result["failed"]
    assert result["passed"]


def test_every_suppression_names_a_check_and_a_reason() -> None:
    """Inline suppressions are `checkov.io/skipN: CKV_ID=reason` annotations (no '=' in reasons,
    which checkov cannot parse) or `# checkov:skip=CKV_ID:reason` comments."""
    templates = ROOT / "deploy" / "k8s" / "dflash-gateway" / "templates"
    found = 0
    for path in [*templates.rglob("*.yaml"), *(ROOT / "docker").glob("*Dockerfile")]:
        for line in path.read_text().splitlines():
            if "checkov.io/skip" in line:
                found += 1
                _, _, value = line.partition(": ")
                check, sep, reason = value.partition("=")
                assert re.fullmatch(r"CKV2?_[A-Z0-9]+_\d+", check) and sep, line
                assert "=" not in reason and len(reason) > 20, line
            if "checkov:skip" in line:
                found += 1
                assert re.search(r"checkov:skip=CKV2?_[A-Z0-9]+_\d+:.{20,}", line), line
    assert found


def test_render_helper_sees_every_template(render: Callable[..., Manifests]) -> None:
    """Between them the value sets render every template at least once (so the checks above see
    every kind the chart can produce)."""
    kinds = {d["kind"] for value_set in VALUE_SETS for d in render(value_set).docs}
    assert kinds == {
        "ConfigMap", "Deployment", "HorizontalPodAutoscaler", "Ingress", "NetworkPolicy", "Pod",
        "PodDisruptionBudget", "PrometheusRule", "Role", "RoleBinding", "ScaledObject", "Secret",
        "Service", "ServiceAccount", "ServiceMonitor", "StatefulSet",
    }  # fmt: skip
