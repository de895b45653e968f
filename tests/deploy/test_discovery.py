"""The gateway, configured by the chart, discovers exactly the chart's workers.

A small model of what the cluster makes of the rendered manifests: pods from the StatefulSet and
Deployment, and for every Service the EndpointSlices the EndpointSlice controller would publish
(labels: the Service's own plus kubernetes.io/service-name; ports named as the Service's) or the
records cluster DNS would serve. The gateway's real discovery code then runs with the settings file
from the chart's ConfigMap: against a loopback Kubernetes API (kubernetes mode) or a resolver
(dns mode). It must find the worker pods, by pod name, on the SGLang port, and nothing else.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from app.config import ENV_PREFIX, Settings, load_settings
from app.workers.discovery import Endpoint, make_discovery
from tests.deploy.conftest import NAMESPACE, RELEASE, Manifests, pod_spec
from tests.support.fake_kube import FakeKubeApi

WORKERS = f"{RELEASE}-dflash-gateway-worker"


def pods(m: Manifests) -> list[dict[str, Any]]:
    """Pods the controllers would create (name, labels, IP, container ports, hostname)."""
    result = []
    net = iter(ipaddress.ip_network("10.244.0.0/16").hosts())
    for owner in m.all("StatefulSet") + m.all("Deployment"):
        template = owner["spec"]["template"]
        ports = {
            p["name"]: p["containerPort"]
            for c in template["spec"]["containers"]
            for p in c["ports"]
        }
        for i in range(owner["spec"].get("replicas", 1)):
            stateful = owner["kind"] == "StatefulSet"
            name = (
                f"{owner['metadata']['name']}-{i}"
                if stateful
                else f"{owner['metadata']['name']}-7d9f8-{i}"
            )
            result.append(
                {
                    "name": name,
                    "labels": template["metadata"]["labels"],
                    "ip": str(next(net)),
                    "ports": ports,
                    "hostname": name if stateful else None,
                }
            )
    return result


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def endpoint_slices(m: Manifests) -> list[dict[str, Any]]:
    slices = []
    for svc in m.all("Service"):
        members = [p for p in pods(m) if selects(svc["spec"]["selector"], p["labels"])]
        slices.append(
            {
                "apiVersion": "discovery.k8s.io/v1",
                "kind": "EndpointSlice",
                "metadata": {
                    "name": f"{svc['metadata']['name']}-abcde",
                    "namespace": svc["metadata"]["namespace"],
                    "labels": {
                        **svc["metadata"]["labels"],
                        "kubernetes.io/service-name": svc["metadata"]["name"],
                        "endpointslice.kubernetes.io/managed-by": "endpointslice-controller.k8s.io",
                    },
                },
                "addressType": "IPv4",
                "ports": [
                    {
                        "name": p["name"],
                        "port": members[0]["ports"][p["targetPort"]],
                        "protocol": "TCP",
                    }
                    for p in svc["spec"]["ports"]
                ]
                if members
                else [],
                "endpoints": [
                    {
                        "addresses": [p["ip"]],
                        "conditions": {"ready": True, "serving": True, "terminating": False},
                        "targetRef": {"kind": "Pod", "name": p["name"], "namespace": NAMESPACE},
                        **({"hostname": p["hostname"]} if p["hostname"] else {}),
                    }
                    for p in members
                ],
            }
        )
    return slices


def expected_workers(m: Manifests) -> list[Endpoint]:
    return sorted(
        (
            Endpoint(name=p["name"], url=f"http://{p['ip']}:30000")
            for p in pods(m)
            if p["name"].startswith(f"{WORKERS}-")
        ),
        key=lambda e: e.name,
    )


def gateway_settings(
    m: Manifests, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, **env: str
) -> Settings:
    import os

    for key in list(os.environ):
        if key.startswith(ENV_PREFIX):
            monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    path = tmp_path / "gateway.yaml"
    path.write_text(m.one("ConfigMap", f"{RELEASE}-dflash-gateway")["data"]["gateway.yaml"])
    return load_settings(config_file=path)


async def first_nonempty(discovery: Any) -> list[Endpoint]:
    found: asyncio.Queue[list[Endpoint]] = asyncio.Queue()
    task = asyncio.create_task(discovery.run(found.put_nowait))
    try:
        while True:
            endpoints = await asyncio.wait_for(found.get(), 10)
            if endpoints:
                return sorted(endpoints, key=lambda e: e.name)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


@pytest.mark.parametrize("value_set", ["default", "ingress-hpa-netpol"])
async def test_kubernetes_mode_finds_exactly_the_worker_pods(
    render: Callable[..., Manifests],
    value_set: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    m = render(value_set)
    token = tmp_path / "token"
    token.write_text("sa-token\n")
    async with FakeKubeApi(namespace=NAMESPACE) as api:
        settings = gateway_settings(
            m,
            tmp_path,
            monkeypatch,
            DFLASH_GATEWAY_DISCOVERY__API_URL=api.url,
            DFLASH_GATEWAY_DISCOVERY__TOKEN_FILE=str(token),
        )
        assert settings.discovery.mode == "kubernetes"
        assert settings.discovery.namespace == NAMESPACE  # the release namespace
        # The Role lets the gateway's ServiceAccount read EndpointSlices in exactly that namespace.
        assert m.one("Role")["metadata"]["namespace"] == settings.discovery.namespace
        slices = endpoint_slices(m)
        # The gateway's own Services (its API, and its metrics port when the ServiceMonitor is on)
        # are decoys the selector must not match.
        gateway_services = {f"{RELEASE}-dflash-gateway"}
        if value_set == "ingress-hpa-netpol":
            gateway_services.add(f"{RELEASE}-dflash-gateway-metrics")
        assert {s["metadata"]["labels"]["kubernetes.io/service-name"] for s in slices} == {
            *gateway_services,
            WORKERS,
        }
        for s in slices:
            await api.put(s)
        found = await first_nonempty(make_discovery(settings.discovery, settings.worker_urls))
    assert found == expected_workers(m)
    assert len(found) == m.workers["spec"]["replicas"]


async def test_dns_mode_resolves_exactly_the_headless_service(
    render: Callable[..., Manifests], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    m = render("four-workers-custom")
    settings = gateway_settings(m, tmp_path, monkeypatch)
    assert settings.discovery.mode == "dns"
    all_pods = pods(m)

    class ClusterDns:
        """Records cluster DNS serves for the rendered Services: a headless Service's name has
        one A record per selected pod; a ClusterIP Service's name has its virtual IP."""

        async def addresses(self, host: str) -> list[str]:
            for svc in m.all("Service"):
                fqdn = f"{svc['metadata']['name']}.{svc['metadata']['namespace']}.svc.cluster.local"
                if host == fqdn:
                    if svc["spec"].get("clusterIP") == "None":
                        return [
                            p["ip"]
                            for p in all_pods
                            if selects(svc["spec"]["selector"], p["labels"])
                        ]
                    return ["10.96.0.10"]
            raise OSError(f"NXDOMAIN {host}")

        async def name_of(self, address: str) -> str | None:
            for p in all_pods:
                if p["ip"] == address and p["hostname"]:
                    return f"{p['hostname']}.{WORKERS}.{NAMESPACE}.svc.cluster.local"
            return None

    from app.workers.discovery import DnsDiscovery

    found = await first_nonempty(DnsDiscovery(settings.discovery, ClusterDns()))
    assert found == expected_workers(m)
    assert len(found) == 4
    # No API access is granted when it is not used.
    assert m.all("Role") == []
    assert pod_spec(m.gateway)["automountServiceAccountToken"] is False


async def test_pd_kubernetes_mode_finds_each_roles_pods_with_the_bootstrap_port(
    render: Callable[..., Manifests], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """workers.disaggregation.discovery kubernetes: the gateway, with the settings file the chart
    renders, finds every prefill pod (with the port of its Service named bootstrap) and every
    decode pod from their own Services' EndpointSlices, and nothing else."""
    m = render("pd-kubernetes-discovery")
    token = tmp_path / "token"
    token.write_text("sa-token\n")
    async with FakeKubeApi(namespace=NAMESPACE) as api:
        settings = gateway_settings(
            m,
            tmp_path,
            monkeypatch,
            DFLASH_GATEWAY_DISCOVERY__API_URL=api.url,
            DFLASH_GATEWAY_DISCOVERY__TOKEN_FILE=str(token),
        )
        assert settings.pd.disaggregation
        assert settings.discovery.mode == "kubernetes"
        assert m.one("Role")["metadata"]["namespace"] == settings.discovery.namespace == NAMESPACE
        for s in endpoint_slices(m):
            await api.put(s)
        found: asyncio.Queue[list[Endpoint]] = asyncio.Queue()
        discovery = make_discovery(settings.discovery, settings.worker_urls, pd=settings.pd)
        task = asyncio.create_task(discovery.run(found.put_nowait))
        try:
            while True:
                endpoints = await asyncio.wait_for(found.get(), 10)
                if {e.role for e in endpoints} == {"prefill", "decode"}:
                    break
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    ips = {p["name"]: p["ip"] for p in pods(m)}
    expected = {
        (f"{RELEASE}-dflash-gateway-{role}-{i}", role, port)
        for role, replicas, port in (("prefill", 2, 8999), ("decode", 3, None))
        for i in range(replicas)
    }
    assert {(e.name, e.role, e.bootstrap_port) for e in endpoints} == expected
    assert all(e.url == f"http://{ips[e.name]}:30000" for e in endpoints)
