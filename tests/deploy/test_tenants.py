"""Tenants and priority scheduling as rendered: one value turns on SGLang's priority scheduling on
the workers and the gateway's priority field together; ``tenants`` become the gateway's own
``tenants`` settings (loaded here by the gateway's Settings), and bad policies fail the install."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from app.config import ENV_PREFIX, Settings, load_settings
from app.tenants.tenant import Tenants
from tests.deploy.conftest import RELEASE, Manifests, container, helm_binary, template
from tests.deploy.test_workers import worker_flags

POLICIES = (
    '{"search-prod":{"weight":4,"priority":"high","maxPriority":"high","tokensPerMin":2000000},'
    '"nightly-evals":{"priority":"low"}}'
)


def _settings(m: Manifests, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Settings:
    """The gateway's settings as its pod gets them: the ConfigMap's file plus the container's
    literal environment."""
    for key in list(os.environ):
        if key.startswith(ENV_PREFIX):
            monkeypatch.delenv(key)
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    for env in container(m.gateway, "gateway").get("env", []):
        if "value" in env:
            monkeypatch.setenv(env["name"], env["value"])
    path = tmp_path / "gateway.yaml"
    path.write_text(m.one("ConfigMap", f"{RELEASE}-dflash-gateway")["data"]["gateway.yaml"])
    return load_settings(config_file=path)


def test_priority_scheduling_is_off_on_both_sides_by_default(
    render: Callable[..., Manifests], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    m = render()
    assert "--enable-priority-scheduling" not in worker_flags(m)
    assert _settings(m, tmp_path, monkeypatch).workers.priority_scheduling is False


def test_one_value_turns_priority_scheduling_on_for_workers_and_gateway(
    render: Callable[..., Manifests], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    m = render("default", "--set", "workers.priorityScheduling=true")
    assert worker_flags(m)["--enable-priority-scheduling"] is None  # a switch
    assert _settings(m, tmp_path, monkeypatch).workers.priority_scheduling is True
    # A settings file saying otherwise does not split them: the environment wins.
    contrary = render(
        "default",
        "--set",
        "workers.priorityScheduling=true",
        "--set",
        "gateway.settings.workers.priority_scheduling=false",
    )
    assert _settings(contrary, tmp_path, monkeypatch).workers.priority_scheduling is True


def test_priority_scheduling_with_external_workers_still_reaches_the_gateway(
    render: Callable[..., Manifests], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    m = render(
        "default",
        "--set",
        "workers.enabled=false",
        "--set",
        "externalWorkers.urls[0]=http://10.0.0.5:30000",
        "--set",
        "workers.priorityScheduling=true",
    )
    assert m.all("StatefulSet") == []
    assert _settings(m, tmp_path, monkeypatch).workers.priority_scheduling is True


def test_tenants_render_into_the_gateways_tenant_policies(
    render: Callable[..., Manifests], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    m = render(
        "default",
        "--set-json",
        f"tenants.keys={POLICIES}",
        "--set",
        "tenants.default.weight=2",
    )
    tenants = Tenants(_settings(m, tmp_path, monkeypatch).tenants)
    search = tenants.resolve("search-prod")
    assert (search.policy.weight, search.priority_name) == (4, "high")
    assert search.policy.tokens_per_min == 2000000
    evals = tenants.resolve("nightly-evals", b"high")  # lowered to its ceiling (default: normal)
    assert (evals.policy.weight, evals.policy.priority, evals.priority_name) == (1, "low", "normal")
    other = tenants.resolve("anyone-else")
    assert (other.policy.weight, other.priority_name) == (2, "normal")
    assert other.policy.tokens_per_min is None


BAD = [
    (
        ["--set-json", 'tenants.keys={"evals":{"priority":"high"}}'],
        "tenants.keys.evals: priority must not be above maxPriority",
    ),
    (["--set", "tenants.default.priority=urgent"], "priority"),
    (["--set", "tenants.default.weight=0"], "weight"),
    (["--set-json", 'tenants.keys={"evals":{"wieght":2}}'], "wieght"),
    (["--set", "workers.priorityScheduling=yes"], "priorityScheduling"),
]


@pytest.mark.parametrize(("args", "fragment"), BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_tenant_values_are_rejected(args: list[str], fragment: str) -> None:
    done = template(helm_binary(4), *args)
    assert done.returncode != 0, f"accepted: {args}"
    assert fragment in done.stderr, done.stderr
