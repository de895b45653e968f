"""Prefill/decode disaggregation as rendered (workers.disaggregation, ci-values/pd-disaggregation):
one StatefulSet and headless Service per role, SGLang's --disaggregation-* flags on top of the
DFLASH seed flags, and the gateway pairing them with sglang-router's CLI shape, every URL naming a
pod of the role's Service."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.deploy.conftest import NAMESPACE, RELEASE, Manifests, container, helm_binary, template
from tests.deploy.test_workers import DEPLOYMENT_FLAGS, SEED_FLAGS, parse_flags

PD = "pd-disaggregation"
FULL = f"{RELEASE}-dflash-gateway"


def _role(m: Manifests, role: str) -> dict[str, Any]:
    return m.one("StatefulSet", f"{FULL}-{role}")


def _gateway_pd_args(m: Manifests) -> tuple[list[tuple[str, str]], list[str]]:
    """The gateway container's --prefill (URL, BOOTSTRAP_PORT) and --decode URL arguments."""
    args = container(m.gateway, "gateway")["args"]
    assert "--pd-disaggregation" in args
    prefill, decode = [], []
    for i, arg in enumerate(args):
        if arg == "--prefill":
            prefill.append((args[i + 1], args[i + 2]))
        elif arg == "--decode":
            decode.append(args[i + 1])
    return prefill, decode


def test_two_roles_replace_the_whole_workers(render: Callable[..., Manifests]) -> None:
    m = render(PD)
    assert {s["metadata"]["name"] for s in m.all("StatefulSet")} == {
        f"{FULL}-prefill",
        f"{FULL}-decode",
    }
    assert {
        s["metadata"]["name"] for s in m.all("Service") if s["spec"].get("clusterIP") == "None"
    } == {
        f"{FULL}-prefill",
        f"{FULL}-decode",
    }
    assert _role(m, "prefill")["spec"]["replicas"] == 2
    assert _role(m, "decode")["spec"]["replicas"] == 3


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_each_role_runs_the_seed_flags_and_its_own(
    render: Callable[..., Manifests], role: str
) -> None:
    sts = _role(render(PD), role)
    c = container(sts, "sglang")
    flags = parse_flags(c["args"])
    for flag, value in {**SEED_FLAGS, **DEPLOYMENT_FLAGS}.items():
        assert flags[flag] == value, f"{role}: {flag}={flags.get(flag)!r}, want {value!r}"
    assert flags["--disaggregation-mode"] == role
    assert flags["--disaggregation-transfer-backend"] == "mooncake"
    assert flags["--disaggregation-ib-device"] == "mlx5_0,mlx5_1"
    extra = {"prefill": "--chunked-prefill-size", "decode": "--cuda-graph-max-bs"}
    assert extra[role] in flags and extra["decode" if role == "prefill" else "prefill"] not in flags
    if role == "prefill":
        assert flags["--disaggregation-bootstrap-port"] == "8999"
        assert {"name": "bootstrap", "containerPort": 8999, "protocol": "TCP"} in c["ports"]
    else:
        assert "--disaggregation-bootstrap-port" not in flags
        assert [p["name"] for p in c["ports"]] == ["http"]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 8


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_each_service_selects_exactly_its_role(render: Callable[..., Manifests], role: str) -> None:
    m = render(PD)
    sts = _role(m, role)
    svc = m.one("Service", f"{FULL}-{role}")
    pod_labels = sts["spec"]["template"]["metadata"]["labels"]
    assert sts["spec"]["serviceName"] == svc["metadata"]["name"]
    assert sts["spec"]["selector"]["matchLabels"] == svc["spec"]["selector"]
    assert svc["spec"]["selector"].items() <= pod_labels.items()
    assert svc["spec"]["selector"]["dflash-gateway.io/role"] == role
    other = _role(m, "decode" if role == "prefill" else "prefill")
    other_labels = other["spec"]["template"]["metadata"]["labels"]
    assert not svc["spec"]["selector"].items() <= other_labels.items()


def test_gateway_args_name_every_pod_of_each_role(render: Callable[..., Manifests]) -> None:
    m = render(PD)
    prefill, decode = _gateway_pd_args(m)
    for role, urls in (("prefill", [u for u, _ in prefill]), ("decode", decode)):
        sts = _role(m, role)
        svc = sts["spec"]["serviceName"]
        want = [
            f"http://{sts['metadata']['name']}-{i}.{svc}.{NAMESPACE}.svc.cluster.local:30000"
            for i in range(sts["spec"]["replicas"])
        ]
        assert urls == want
    prefill_port = m.one("Service", f"{FULL}-prefill")["spec"]["ports"]
    assert {"name": "bootstrap", "port": 8999, "targetPort": "bootstrap", "protocol": "TCP"} in (
        prefill_port
    )
    assert {port for _, port in prefill} == {"8999"}


def test_gateway_uses_the_listed_workers_only(render: Callable[..., Manifests]) -> None:
    """Static discovery (the PD lists), so no EndpointSlice watch, Role or API token."""
    m = render(PD)
    assert m.gateway_settings()["discovery"] == {"mode": "static"}
    assert m.all("Role") == [] and m.all("RoleBinding") == []
    assert m.gateway["spec"]["template"]["spec"]["automountServiceAccountToken"] is False


def test_gateway_cli_takes_the_rendered_pd_args(
    render: Callable[..., Manifests], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The gateway's own parser and settings take the container's arguments as they are."""
    import app.__main__ as cli
    from app.config import ENV_PREFIX, load_settings

    parser = cli.build_parser()
    if "--pd-disaggregation" not in cli.serve_parser().format_help():
        pytest.skip("this gateway build has no PD mode (serve --pd-disaggregation)")
    import os

    for key in list(os.environ):
        if key.startswith(ENV_PREFIX):
            monkeypatch.delenv(key)
    m = render(PD)
    args = parser.parse_args(["serve", *container(m.gateway, "gateway")["args"]])
    path = tmp_path / "gateway.yaml"
    path.write_text(m.one("ConfigMap", FULL)["data"]["gateway.yaml"])
    pd = cli._pd_flags(args)  # what `serve` merges into the settings
    settings = load_settings(config_file=path, pd=pd)
    assert settings.pd.disaggregation
    assert [url for url, _ in settings.pd.prefill_workers()] == [
        u for u, _ in _gateway_pd_args(m)[0]
    ]
    assert {port for _, port in settings.pd.prefill_workers()} == {8999}
    assert settings.pd.decode == _gateway_pd_args(m)[1]
    assert not settings.embedded_default


def test_workers_reach_each_other(render: Callable[..., Manifests]) -> None:
    """The decode servers reach the prefill servers' bootstrap port and the KV transfer's ports;
    the whole-worker chart keeps workers apart."""

    def worker_rules(m: Manifests) -> list[dict[str, Any]]:
        policy = m.one("NetworkPolicy", f"{FULL}-worker")
        rules: list[dict[str, Any]] = policy["spec"]["ingress"]
        return rules

    worker_peer = {
        "podSelector": {
            "matchLabels": {
                "app.kubernetes.io/name": "dflash-gateway",
                "app.kubernetes.io/instance": RELEASE,
                "app.kubernetes.io/component": "worker",
            }
        }
    }
    assert {"from": [worker_peer]} in worker_rules(render(PD))
    assert all(worker_peer not in r.get("from", []) for r in worker_rules(render()))
    # With the workers' egress restricted, they may still reach each other (and only PD's do).
    egress = render(PD).one("NetworkPolicy", f"{FULL}-worker-egress")["spec"]["egress"]
    assert {"to": [worker_peer]} in egress
    whole = render("ingress-hpa-netpol").one("NetworkPolicy", "ci-dflash-gateway-worker-egress")
    assert all(worker_peer not in rule.get("to", []) for rule in whole["spec"]["egress"])


def test_worker_servicemonitor_scrapes_both_roles(render: Callable[..., Manifests]) -> None:
    m = render(PD)
    monitor = m.one("ServiceMonitor", f"{FULL}-worker")
    selector = monitor["spec"]["selector"]["matchLabels"]
    for role in ("prefill", "decode"):
        assert selector.items() <= m.one("Service", f"{FULL}-{role}")["metadata"]["labels"].items()


PD_ON = ["--set", "workers.disaggregation.enabled=true"]
BAD_PD_VALUES = [
    (
        [*PD_ON, "--set", "workers.engine=vllm", "--set", "workers.gpus=8"],
        "needs workers.engine sglang",
    ),
    (
        [
            *PD_ON,
            "--set",
            "workers.autoscaling.keda.enabled=true",
            "--set",
            "workers.autoscaling.keda.serverAddress=http://prometheus:9090",
        ],
        "turn it off with workers.disaggregation",
    ),
    ([*PD_ON, "--set", "workers.decode.gpus=4"], "workers.decode.gpus (4) must equal"),
    ([*PD_ON, "--set", "workers.prefill.bootstrapPort=30000"], "must differ from workers.port"),
    ([*PD_ON, "--set", "workers.disaggregation.transferBackend=carrier-pigeon"], "transferBackend"),
    ([*PD_ON, "--set", "workers.prefill.replicas=0"], "replicas"),
]


@pytest.mark.parametrize(
    ("args", "fragment"), BAD_PD_VALUES, ids=[" ".join(a[2:]) for a, _ in BAD_PD_VALUES]
)
def test_bad_pd_values_are_rejected(args: list[str], fragment: str) -> None:
    done = template(helm_binary(4), *args)
    assert done.returncode != 0, f"accepted: {args}"
    assert fragment in done.stderr, done.stderr


def test_pd_off_renders_no_role_objects(render: Callable[..., Manifests]) -> None:
    m = render()
    assert [s["metadata"]["name"] for s in m.all("StatefulSet")] == [f"{FULL}-worker"]
    assert not any("disaggregation" in arg for arg in container(m.workers, "sglang")["args"])
    assert "--pd-disaggregation" not in container(m.gateway, "gateway")["args"]
    assert "dflash-gateway.io/role" not in m.workers["spec"]["selector"]["matchLabels"]


def test_kubernetes_discovery_option_watches_each_roles_slices(
    render: Callable[..., Manifests], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """workers.disaggregation.discovery kubernetes: no pod list on the command line; the settings
    name each role's Service's EndpointSlices, and the Role and token the watch needs are there.
    The default stays static."""
    import os

    import app.__main__ as cli
    from app.config import ENV_PREFIX, load_settings

    assert "--prefill" in container(render(PD).gateway, "gateway")["args"]
    m = render("pd-kubernetes-discovery")
    args = container(m.gateway, "gateway")["args"]
    assert "--pd-disaggregation" in args
    assert "--prefill" not in args and "--decode" not in args
    assert m.gateway_settings()["discovery"] == {
        "mode": "kubernetes",
        "namespace": NAMESPACE,
        "prefill_label_selector": f"kubernetes.io/service-name={FULL}-prefill",
        "decode_label_selector": f"kubernetes.io/service-name={FULL}-decode",
        "bootstrap_port_name": "bootstrap",
        "port_name": "http",
        "resync_s": 20,
    }
    # The names the selectors give are the role Services', whose ports carry those names.
    for role in ("prefill", "decode"):
        names = {p["name"] for p in m.one("Service", f"{FULL}-{role}")["spec"]["ports"]}
        assert names == ({"http", "bootstrap"} if role == "prefill" else {"http"})
    [rule] = m.one("Role")["rules"]
    assert rule["resources"] == ["endpointslices"] and rule["verbs"] == ["get", "list", "watch"]
    assert m.gateway["spec"]["template"]["spec"]["automountServiceAccountToken"] is True

    for key in list(os.environ):
        if key.startswith(ENV_PREFIX):
            monkeypatch.delenv(key)
    monkeypatch.setenv(f"{ENV_PREFIX}DISCOVERY__API_URL", "https://10.96.0.1:443")
    path = tmp_path / "gateway.yaml"
    path.write_text(m.one("ConfigMap", FULL)["data"]["gateway.yaml"])
    parsed = cli.build_parser().parse_args(["serve", *args])
    settings = load_settings(config_file=path, pd=cli._pd_flags(parsed))
    assert settings.pd.disaggregation and not settings.pd.prefill
    assert settings.pd.bootstrap_port == 8999  # for a slice without the bootstrap port
    assert not settings.embedded_default
