"""The chart itself: `helm lint --strict` with Helm 4 and Helm 3 on every value set, identical
renders from both, and values.schema.json / the chart's own checks rejecting bad values."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tests.deploy.conftest import CHART, VALUE_SETS, helm_binary, run, template, values_args


@pytest.mark.parametrize("major", [4, 3])
@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_helm_lint_strict(major: int, value_set: str) -> None:
    done = run([helm_binary(major), "lint", "--strict", CHART, *values_args(value_set)])
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 chart(s) failed" in done.stdout


def test_chart_is_api_v2_with_kube_version() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["apiVersion"] == "v2"
    assert chart["type"] == "application"
    assert chart["kubeVersion"].startswith(">=")


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_helm3_and_helm4_render_the_same(value_set: str) -> None:
    h4 = template(helm_binary(4), *values_args(value_set))
    h3 = template(helm_binary(3), *values_args(value_set))
    assert h4.returncode == 0, h4.stderr
    assert h3.returncode == 0, h3.stderr
    assert list(yaml.safe_load_all(h4.stdout)) == list(yaml.safe_load_all(h3.stdout))


def test_helm_package(tmp_path: Path) -> None:
    done = run([helm_binary(4), "package", CHART, "--destination", tmp_path])
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "dflash-gateway-0.1.0.tgz").exists()


# (--set arguments, a fragment of the expected error). Types first, then the chart's own checks.
BAD_VALUES = [
    (["--set", "workers.replicas=two"], "workers"),
    (["--set", "gateway.replicas=-1"], "gateway"),
    (["--set-string", "workers.gpus=8"], "gpus"),
    (["--set", "workers.sglang.memFractionStatic=high"], "memFractionStatic"),
    (["--set", "workers.sglang.memFractionStatic=1.5"], "memFractionStatic"),
    (["--set", "workers.sglang.trustRemoteCode=maybe"], "trustRemoteCode"),
    (["--set", "workers.sglang.extraArgs=--foo"], "extraArgs"),
    (["--set", "gateway.policy=fastest"], "policy"),
    (["--set", "gateway.discovery.mode=consul"], "mode"),
    (["--set", "workers.modelCache.type=s3"], "type"),
    (["--set", "workers.image.pullPolicy=Sometimes"], "pullPolicy"),
    (["--set", "workers.image.digest=latest"], "digest"),
    (["--set", "externalWorkers.urls[0]=10.0.0.5:30000"], "urls"),
    (["--set", "metrics.serviceMonitor.interval=often"], "interval"),
    (["--set", "gateway.resources.limits.cpu=lots"], "cpu"),
    (["--set", "gateway.unknownKey=1"], "unknownKey"),
    (["--set", "workers.sglang.draftWindow=4096"], "draftWindow"),
    (["--set", "topLevelTypo=true"], "topLevelTypo"),
    (["--set", "workers.gpus=4"], "must equal workers.sglang.tpSize"),
    (
        ["--set", "workers.engine=vllm", "--set", "workers.gpus=4"],
        "must equal workers.vllm.tensorParallelSize",
    ),
    (
        ["--set", "workers.engine=vllm", "--set", "workers.priorityScheduling=true"],
        "workers.priorityScheduling is SGLang's",
    ),
    (["--set", "workers.engine=tgi"], "engine"),
    (["--set", "externalWorkers.urls[0]=http://10.0.0.5:30000"], "needs workers.enabled=false"),
    (["--set", "workers.enabled=false"], "needs externalWorkers.urls"),
    (["--set", "gateway.terminationGracePeriodSeconds=30"], "terminationGracePeriodSeconds"),
    (
        ["--set", "workers.autoscaling.keda.enabled=true"],
        "workers.autoscaling.keda.serverAddress is required",
    ),
    (["--set", "workers.autoscaling.keda.minReplicas=0"], "minReplicas"),
    # A number where KEDA wants a string (as a values file would give it).
    (["--set-json", "workers.autoscaling.keda.threshold=0.8"], "threshold"),
    (
        ["--set", "workers.modelCache.type=existingClaim"],
        "workers.modelCache.existingClaim is required",
    ),
]


@pytest.mark.parametrize(("args", "fragment"), BAD_VALUES, ids=[" ".join(a) for a, _ in BAD_VALUES])
def test_bad_values_are_rejected(args: list[str], fragment: str) -> None:
    done = template(helm_binary(4), *args)
    assert done.returncode != 0, f"accepted: {args}"
    assert fragment in done.stderr, done.stderr


def test_schema_is_strict_everywhere() -> None:
    """Every object in values.schema.json that lists properties forbids unknown ones (typos in
    values fail the install instead of being ignored), except free-form maps."""
    import json

    schema = json.loads((CHART / "values.schema.json").read_text())
    loose = []

    def walk(node: object, where: str) -> None:
        if isinstance(node, dict):
            if "properties" in node and node.get("additionalProperties") is not False:
                loose.append(where)
            for key, child in node.items():
                walk(child, f"{where}/{key}")
        elif isinstance(node, list):
            for i, child in enumerate(node):
                walk(child, f"{where}/{i}")

    walk(schema, "")
    assert loose == []


def test_every_value_is_documented() -> None:
    """values.yaml is documented line by line: every key has a comment right above it, or sits
    inside a value documented as a whole (a key whose line, or an ancestor's, has one)."""
    lines = (CHART / "values.yaml").read_text().splitlines()

    def indent(line: str) -> int:
        return len(line) - len(line.lstrip(" -"))

    def commented(i: int) -> bool:
        return i > 0 and lines[i - 1].strip().startswith("#")

    undocumented = []
    for i, line in enumerate(lines):
        stripped = line.strip()
        if not stripped or stripped.startswith("#") or ":" not in stripped:
            continue
        if stripped.endswith(":") and indent(line) == 0:
            continue  # top-level section (gateway:, workers:, ...): its keys are documented
        chain, level = [i], indent(line)
        for j in range(i - 1, -1, -1):
            above = lines[j]
            if above.strip() and not above.strip().startswith("#") and indent(above) < level:
                chain.append(j)
                level = indent(above)
        if any(commented(k) for k in chain):
            continue
        if stripped.endswith(":"):
            continue  # a sub-section; its keys are checked on their own lines
        undocumented.append(f"{i + 1}: {stripped}")
    assert undocumented == []


def test_documented_install_command_renders(tmp_path: Path) -> None:
    """The `helm install` command in docs/deploy.md renders with this chart."""
    import re
    import shlex

    from tests.deploy.conftest import ROOT

    deploy = (ROOT / "docs" / "deploy.md").read_text()
    match = re.search(r"^helm install (.*?[^\\])$", deploy, re.M | re.S)
    assert match, "no helm install command in docs/deploy.md"
    words = shlex.split(match.group(1).replace("\\\n", " "))
    release, chart, *args = words
    assert (ROOT / chart).resolve() == CHART
    done = template(helm_binary(4), *args, release=release)
    assert done.returncode == 0, done.stderr
    docs = [d for d in yaml.safe_load_all(done.stdout) if d]
    [sts] = [d for d in docs if d["kind"] == "StatefulSet"]
    assert sts["spec"]["template"]["spec"]["nodeSelector"] == {
        "nvidia.com/gpu.product": "NVIDIA-B200"
    }
