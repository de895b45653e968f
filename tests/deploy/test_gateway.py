"""The gateway tier as rendered: pod hardening, probes, draining, the settings file (validated by
the gateway's own Settings), keys from Secrets, RBAC, Ingress, HPA, PDB, NetworkPolicy."""

from __future__ import annotations

import ipaddress
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from app.__main__ import build_parser
from app.config import ENV_PREFIX, Settings, load_settings
from app.media_policy import CLUSTER_SUFFIXES
from tests.deploy.conftest import NAMESPACE, RELEASE, VALUE_SETS, Manifests, container, pod_spec


def test_gateway_pod_is_non_root_with_read_only_root(render: Callable[..., Manifests]) -> None:
    dep = render().gateway
    spec = pod_spec(dep)
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert spec["securityContext"]["runAsUser"] >= 10000
    assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    sec = container(dep, "gateway")["securityContext"]
    assert sec["readOnlyRootFilesystem"] is True
    assert sec["allowPrivilegeEscalation"] is False
    assert sec["capabilities"]["drop"] == ["ALL"]
    # The only writable path is an emptyDir /tmp (multi-process metrics, temp files).
    mounts = {m["mountPath"]: m for m in container(dep, "gateway")["volumeMounts"]}
    assert "/tmp" in mounts
    assert all(m.get("readOnly") for path, m in mounts.items() if path != "/tmp")
    res = container(dep, "gateway")["resources"]
    assert set(res) == {"requests", "limits"}
    assert set(res["limits"]) == {"cpu", "memory"}


def test_gateway_probes(render: Callable[..., Manifests]) -> None:
    c = container(render().gateway, "gateway")
    assert c["ports"] == [{"name": "http", "containerPort": 8000, "protocol": "TCP"}]
    assert c["livenessProbe"]["httpGet"] == {"path": "/livez", "port": "http"}
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}


def test_gateway_drains_streams_before_it_is_killed(render: Callable[..., Manifests]) -> None:
    m = render()
    spec = pod_spec(m.gateway)
    pre_stop = container(m.gateway, "gateway")["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    sleep_s = int(pre_stop[1])
    drain_s = m.gateway_settings()["drain_s"]
    assert sleep_s >= 5
    assert drain_s >= 300  # a long Kimi-K2.5 stream runs for minutes
    assert spec["terminationGracePeriodSeconds"] > sleep_s + drain_s
    assert m.gateway["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0


def test_no_service_links_into_the_gateway_env(render: Callable[..., Manifests]) -> None:
    """A Service named like the release would inject DFLASH_GATEWAY_PORT=tcp://..., which the
    gateway would read as its port setting."""
    for value_set in VALUE_SETS:
        m = render(value_set)
        for owner in m.all("Deployment") + m.all("StatefulSet"):
            assert pod_spec(owner)["enableServiceLinks"] is False
        assert m.one("Pod")["spec"]["enableServiceLinks"] is False


def test_gateway_args_are_the_cli_the_image_runs(render: Callable[..., Manifests]) -> None:
    """The container adds only flags to the image's `dflash-gateway serve` entrypoint."""
    c = container(render().gateway, "gateway")
    assert "command" not in c
    args = build_parser().parse_args(["serve", *c["args"]])
    assert args.config_file == "/etc/dflash-gateway/gateway.yaml"
    assert (args.host, args.port) == ("0.0.0.0", 8000)
    [mount] = [m for m in c["volumeMounts"] if m["name"] == "config"]
    assert mount["mountPath"] == "/etc/dflash-gateway"


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_settings_file_is_valid_gateway_settings(
    render: Callable[..., Manifests],
    value_set: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The ConfigMap's gateway.yaml loads with the gateway's own Settings (extra keys forbidden)."""
    import os

    for key in list(os.environ):
        if key.startswith(ENV_PREFIX):
            monkeypatch.delenv(key)
    # As in a pod: the API server address comes from the environment.
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    m = render(value_set)
    path = tmp_path / "gateway.yaml"
    path.write_text(m.one("ConfigMap", f"{RELEASE}-dflash-gateway")["data"]["gateway.yaml"])
    settings = load_settings(config_file=path)
    assert settings.host == "0.0.0.0"
    assert settings.port == container(m.gateway, "gateway")["ports"][0]["containerPort"]
    if "--pd-disaggregation" in container(m.gateway, "gateway")["args"]:
        return  # the workers are in the container's flags: tests/deploy/test_pd.py
    assert not settings.embedded_default  # never starts emulators in a cluster


def test_a_metrics_port_is_reachable_by_prometheus(render: Callable[..., Manifests]) -> None:
    """The gateway binds metrics_port to loopback unless told otherwise; in a pod Prometheus
    scrapes from outside, so the chart binds it to every address (unless metrics_host is set)."""
    assert "metrics_host" not in render().gateway_settings()
    given = render("default", "--set", "gateway.settings.metrics_port=9100").gateway_settings()
    assert (given["metrics_port"], given["metrics_host"]) == (9100, "0.0.0.0")
    pinned = render(
        "default",
        "--set",
        "gateway.settings.metrics_port=9100",
        "--set",
        "gateway.settings.metrics_host=10.0.0.1",
    ).gateway_settings()
    assert pinned["metrics_host"] == "10.0.0.1"


def test_client_keys_are_a_reloadable_keys_file(render: Callable[..., Manifests]) -> None:
    """Client keys: a Secret holding NAME:KEY lines, mounted as a directory (so Secret edits reach
    the pod) and named by the settings' auth.keys_file; never in env or the ConfigMap."""
    import base64

    from app.auth.keystore import parse_entries

    m = render("external-workers")
    c = container(m.gateway, "gateway")
    settings = m.gateway_settings()
    keys_file = Path(settings["auth"]["keys_file"])
    [mount] = [v for v in c["volumeMounts"] if v["name"] == "api-keys"]
    assert mount["mountPath"] == str(keys_file.parent) and "subPath" not in mount
    [volume] = [v for v in pod_spec(m.gateway)["volumes"] if v["name"] == "api-keys"]
    secret = m.one("Secret", volume["secret"]["secretName"])
    content = base64.b64decode(secret["data"][keys_file.name]).decode()
    entries = parse_entries(content.splitlines())
    assert [e.name for e in entries] == ["team-a", "team-b"]
    env_names = [e["name"] for e in c.get("env", [])]
    assert "DFLASH_GATEWAY_API_KEYS" not in env_names
    assert (
        "ci-client-key"
        not in m.one("ConfigMap", f"{RELEASE}-dflash-gateway")["data"]["gateway.yaml"]
    )
    # The workers' key: one Secret, read by the gateway (setting) and the workers (--api-key).
    env = {e["name"]: e for e in c["env"]}
    worker_key = env["DFLASH_GATEWAY_WORKER_API_KEY"]["valueFrom"]["secretKeyRef"]
    assert base64.b64decode(m.one("Secret", worker_key["name"])["data"][worker_key["key"]]) == (
        b"ci-worker-key"
    )


def test_existing_secrets_are_referenced_not_created(render: Callable[..., Manifests]) -> None:
    m = render("ingress-hpa-netpol")
    assert m.all("Secret") == []
    [volume] = [v for v in pod_spec(m.gateway)["volumes"] if v["name"] == "api-keys"]
    assert volume["secret"]["secretName"] == "dflash-client-keys"
    assert m.gateway_settings()["auth"]["keys_file"] == "/var/run/secrets/dflash-gateway/api-keys"
    env = {e["name"]: e for e in container(m.gateway, "gateway")["env"]}
    assert env["DFLASH_GATEWAY_WORKER_API_KEY"]["valueFrom"]["secretKeyRef"]["name"] == (
        "dflash-worker-key"
    )
    worker_env = {e["name"]: e for e in container(m.workers, "sglang")["env"]}
    assert worker_env["SGLANG_WORKER_API_KEY"]["valueFrom"]["secretKeyRef"]["name"] == (
        "dflash-worker-key"
    )


def test_open_gateway_by_default_has_no_key_env(render: Callable[..., Manifests]) -> None:
    env = container(render().gateway, "gateway").get("env") or []
    assert not [e for e in env if "KEY" in e["name"]]


def test_rbac_allows_only_reading_endpointslices(render: Callable[..., Manifests]) -> None:
    m = render()
    role = m.one("Role")
    assert role["metadata"]["namespace"] == NAMESPACE
    assert role["rules"] == [
        {
            "apiGroups": ["discovery.k8s.io"],
            "resources": ["endpointslices"],
            "verbs": ["get", "list", "watch"],
        }
    ]
    binding = m.one("RoleBinding")
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": role["metadata"]["name"],
    }
    sa = m.one("ServiceAccount")
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": sa["metadata"]["name"], "namespace": NAMESPACE}
    ]
    spec = pod_spec(m.gateway)
    assert spec["serviceAccountName"] == sa["metadata"]["name"]
    assert spec["automountServiceAccountToken"] is True  # the token the watch uses
    assert sa["automountServiceAccountToken"] is False


def test_ingress_is_sse_safe(render: Callable[..., Manifests]) -> None:
    m = render("ingress-hpa-netpol")
    ing = m.one("Ingress")
    notes = ing["metadata"]["annotations"]
    assert notes["nginx.ingress.kubernetes.io/proxy-buffering"] == "off"
    assert notes["nginx.ingress.kubernetes.io/proxy-request-buffering"] == "off"
    assert int(notes["nginx.ingress.kubernetes.io/proxy-read-timeout"]) >= 600
    assert int(notes["nginx.ingress.kubernetes.io/proxy-send-timeout"]) >= 600
    assert ing["spec"]["ingressClassName"] == "nginx"
    [rule] = ing["spec"]["rules"]
    assert rule["host"] == "llm.example.com"
    [path] = rule["http"]["paths"]
    assert path["backend"]["service"] == {"name": "ci-dflash-gateway", "port": {"name": "http"}}
    assert ing["spec"]["tls"][0]["secretName"] == "llm-example-com-tls"
    assert render().all("Ingress") == []


def test_hpa_owns_the_replica_count(render: Callable[..., Manifests]) -> None:
    m = render("ingress-hpa-netpol")
    hpa = m.one("HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": m.gateway["metadata"]["name"],
    }
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (3, 12)
    assert "replicas" not in m.gateway["spec"]
    assert render().gateway["spec"]["replicas"] == 2
    assert render().all("HorizontalPodAutoscaler") == []


def _selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def test_pdbs_select_their_pods(render: Callable[..., Manifests]) -> None:
    m = render()
    pdbs = {p["metadata"]["name"]: p for p in m.all("PodDisruptionBudget")}
    gateway_labels = m.gateway["spec"]["template"]["metadata"]["labels"]
    worker_labels = m.workers["spec"]["template"]["metadata"]["labels"]
    gw = pdbs["ci-dflash-gateway"]["spec"]["selector"]["matchLabels"]
    wk = pdbs["ci-dflash-gateway-worker"]["spec"]["selector"]["matchLabels"]
    assert _selects(gw, gateway_labels) and not _selects(gw, worker_labels)
    assert _selects(wk, worker_labels) and not _selects(wk, gateway_labels)


def test_network_policies_let_only_the_gateway_reach_workers(
    render: Callable[..., Manifests],
) -> None:
    m = render("ingress-hpa-netpol")
    policies = {p["metadata"]["name"]: p for p in m.all("NetworkPolicy")}
    gateway_labels = m.gateway["spec"]["template"]["metadata"]["labels"]
    test_labels = m.one("Pod")["metadata"]["labels"]
    worker_np = policies["ci-dflash-gateway-worker"]["spec"]
    assert _selects(
        worker_np["podSelector"]["matchLabels"], m.workers["spec"]["template"]["metadata"]["labels"]
    )
    rule, kv_rule = worker_np["ingress"]  # the worker port; the KV events port (kvEvents on)
    assert kv_rule["ports"] == [{"port": "kv-events", "protocol": "TCP"}]
    kv_peers = [p["podSelector"]["matchLabels"] for p in kv_rule["from"]]
    assert [_selects(p, gateway_labels) for p in kv_peers] == [True]
    pod_peers = [p["podSelector"]["matchLabels"] for p in rule["from"] if "podSelector" in p]
    assert [_selects(p, gateway_labels) for p in pod_peers] == [True]
    assert not any(_selects(p, test_labels) for p in pod_peers)
    assert {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}
    } in rule["from"]
    gateway_np = policies["ci-dflash-gateway"]["spec"]
    rule, metrics_rule = gateway_np["ingress"]
    assert metrics_rule == {  # the metrics port (the ServiceMonitor is on): scrapers only
        "ports": [{"port": "metrics", "protocol": "TCP"}],
        "from": [
            {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
        ],
    }
    peers = rule["from"]
    assert any(
        "podSelector" in p and _selects(p["podSelector"]["matchLabels"], test_labels) for p in peers
    )
    assert {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ingress-nginx"}}
    } in peers
    # Default: policies on, gateway open to any source, workers to the gateway only.
    default = {p["metadata"]["name"]: p for p in render().all("NetworkPolicy")}
    assert "from" not in default["ci-dflash-gateway"]["spec"]["ingress"][0]
    assert render("external-workers").all("NetworkPolicy") == []


def test_workers_egress_policy_is_opt_in_and_reaches_only_dns_and_public_addresses(
    render: Callable[..., Manifests],
) -> None:
    """networkPolicy.workersEgress: off by default; on, the workers reach the cluster DNS, public
    addresses on 443 and the extra rules, and nothing the media-URL policy refuses."""
    assert not any(p["metadata"]["name"].endswith("-egress") for p in render().all("NetworkPolicy"))
    m = render("ingress-hpa-netpol")
    policy = m.one("NetworkPolicy", "ci-dflash-gateway-worker-egress")["spec"]
    assert policy["policyTypes"] == ["Egress"]
    assert _selects(
        policy["podSelector"]["matchLabels"], m.workers["spec"]["template"]["metadata"]["labels"]
    )
    assert not _selects(
        policy["podSelector"]["matchLabels"], m.gateway["spec"]["template"]["metadata"]["labels"]
    )
    dns, public, extra = policy["egress"]
    assert {(p["port"], p["protocol"]) for p in dns["ports"]} == {(53, "UDP"), (53, "TCP")}
    assert dns["to"][0]["podSelector"] == {"matchLabels": {"k8s-app": "kube-dns"}}
    assert public["ports"] == [{"port": 443, "protocol": "TCP"}]
    blocks = [peer["ipBlock"] for peer in public["to"]]
    assert set(peer for peer in public["to"][0]) == {"ipBlock"}
    # Every address the media-URL policy refuses is outside the public blocks.
    for address in (
        "169.254.169.254",
        "10.96.0.1",
        "172.20.0.5",
        "192.168.1.1",
        "127.0.0.1",
        "100.64.0.1",
        "fd00::1",
        "fe80::1",
        "::ffff:169.254.169.254",
        "2002:a9fe:a9fe::",
        "64:ff9b::a9fe:a9fe",
    ):
        assert not _in_blocks(address, blocks), address
    for address in ("8.8.8.8", "1.1.1.1", "2606:4700:4700::1111"):
        assert _in_blocks(address, blocks), address
    assert extra == {
        "to": [{"ipBlock": {"cidr": "10.20.0.0/16"}}],
        "ports": [{"port": 443, "protocol": "TCP"}],
    }
    # Off with the workers: nothing to restrict.
    assert (
        render("external-workers", "--set", "networkPolicy.workersEgress.enabled=true").all(
            "NetworkPolicy"
        )
        == []
    )


def _in_blocks(address: str, blocks: list[dict[str, Any]]) -> bool:
    ip = ipaddress.ip_address(address)
    return any(
        ip.version == ipaddress.ip_network(b["cidr"]).version
        and ip in ipaddress.ip_network(b["cidr"])
        and not any(ip in ipaddress.ip_network(e) for e in b.get("except", ()))
        for b in blocks
    )


def test_the_gateway_refuses_media_urls_naming_its_own_namespace(
    render: Callable[..., Manifests],
) -> None:
    """The rendered settings keep the gateway's cluster suffixes and add the release's and the
    workers' namespaces (a Service there is ``name.namespace``)."""
    for extra, namespaces in (
        ((), [NAMESPACE]),
        (("--set", "gateway.discovery.namespace=gpu"), [NAMESPACE, "gpu"]),
    ):
        m = render("default", *extra)
        gateway_yaml = m.one("ConfigMap", f"{RELEASE}-dflash-gateway")["data"]["gateway.yaml"]
        suffixes = yaml.safe_load(gateway_yaml)["limits"]["image_url_cluster_suffixes"]
        assert suffixes == [*CLUSTER_SUFFIXES, *namespaces]
        assert Settings(limits={"image_url_cluster_suffixes": suffixes})


def test_helm_test_pod_sends_one_chat_completion(render: Callable[..., Manifests]) -> None:
    m = render("external-workers")
    pod = m.one("Pod")
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    c = pod["spec"]["containers"][0]
    env = {e["name"]: e for e in c["env"]}
    svc = m.one("Service", "ci-dflash-gateway")
    assert (
        env["GATEWAY_URL"]["value"] == f"http://ci-dflash-gateway:{svc['spec']['ports'][0]['port']}"
    )
    assert env["MODEL"]["value"] == "moonshotai/Kimi-K2.5"
    assert env["KEYS_FILE"]["value"] == "/var/run/secrets/dflash-gateway/api-keys"
    [volume] = [v for v in pod["spec"]["volumes"] if v["name"] == "api-keys"]
    assert volume["secret"]["secretName"] == "ci-dflash-gateway-api-keys"
    script = c["args"][0]
    assert "curl" in script and "/v1/chat/completions" in script
    assert "--fail-with-body" in script and '"choices"' in script
    assert pod["spec"]["restartPolicy"] == "Never"
    # The served model name follows --served-model-name when it is set.
    custom = render("four-workers-custom").one("Pod")["spec"]["containers"][0]["env"]
    assert {"name": "MODEL", "value": "kimi-k2.5"} in custom


FIRST_KEY = "sk-first-0123456789abcdef"
BARE_KEY = "sk-bare-0123456789abcdef"
KEYS_FILES = {
    f"# comment\n\nteam-a:{FIRST_KEY}\nteam-b:sk-second-0123456789abcdef\n": FIRST_KEY,
    f"{BARE_KEY}\n": BARE_KEY,
}


@pytest.mark.parametrize("keys_file", [*KEYS_FILES, None])
def test_helm_test_script_sends_the_first_key(
    render: Callable[..., Manifests], tmp_path: Path, keys_file: str | None
) -> None:
    """Run the test pod's script with sh and a stand-in curl: it sends the first key of the keys
    file (or none when there is no file) and fails unless the answer has choices."""
    import os
    import stat
    import subprocess

    pod = render("external-workers").one("Pod")
    script = pod["spec"]["containers"][0]["args"][0]
    fake = tmp_path / "bin" / "curl"
    fake.parent.mkdir()
    fake.write_text(
        "#!/bin/sh\n"
        'printf "%s\\n" "$@" > "$ARGS_OUT"\n'
        'while [ $# -gt 0 ]; do if [ "$1" = -o ]; then shift; out="$1"; fi; shift; done\n'
        'printf \'{"choices": [{"message": {"content": "hello"}}]}\' > "$out"\n'
    )
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    keys = tmp_path / "api-keys"
    if keys_file is not None:
        keys.write_text(keys_file)
    script = script.replace("/tmp/out.json", str(tmp_path / "out.json"))
    env = {
        "PATH": f"{fake.parent}:{os.environ['PATH']}",
        "GATEWAY_URL": "http://gw:8000",
        "MODEL": "moonshotai/Kimi-K2.5",
        "KEYS_FILE": str(keys),
        "ARGS_OUT": str(tmp_path / "args"),
    }
    done = subprocess.run(
        ["sh", "-c", script], env=env, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr
    args = (tmp_path / "args").read_text().splitlines()
    assert "http://gw:8000/v1/chat/completions" in args
    want = KEYS_FILES
    if keys_file is None:
        assert not [a for a in args if a.startswith("Authorization")]
    else:
        assert f"Authorization: Bearer {want[keys_file]}" in args
    import json

    body = json.loads(args[args.index("-d") + 1])
    assert body["model"] == "moonshotai/Kimi-K2.5"
    assert body["messages"][0]["role"] == "user"
