"""Where workers come from: a static list, DNS of a headless Service, or Kubernetes EndpointSlices
(per role, too, for prefill/decode disaggregation).

Each source is a ``Discovery`` whose ``run(publish)`` calls ``publish(endpoints)`` with the whole
current set every time it may have changed, until cancelled. The pool reconciles against that
snapshot, so a source never has to describe deltas correctly — which is what lets the Kubernetes
source heal a missed watch event with a periodic full re-list instead of leaving a zombie worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import socket
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

import httpx
import orjson

from app.workers.config import DiscoveryConfig, PDConfig
from app.workers.worker import Role, stable_name

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Endpoint:
    name: str  # stable: the pod name when discovery knows it, else host:port
    url: str
    draining: bool = False  # terminating: finish in-flight requests, take no new ones
    role: Role = "whole"  # prefill/decode disaggregation: the worker's part (docs/pd.md)
    bootstrap_port: int | None = None  # a prefill worker's bootstrap port


Publish = Callable[[list[Endpoint]], None]


class Discovery(Protocol):
    async def run(self, publish: Publish) -> None: ...


def _url(host: str, port: int) -> str:
    with contextlib.suppress(ValueError):
        if ipaddress.ip_address(host).version == 6:
            return f"http://[{host}]:{port}"
    return f"http://{host}:{port}"


class StaticDiscovery:
    def __init__(self, urls: Sequence[str]) -> None:
        self._endpoints = [Endpoint(name=stable_name(url), url=url) for url in urls]

    async def run(self, publish: Publish) -> None:
        publish(list(self._endpoints))
        await asyncio.Event().wait()  # nothing ever changes; stay until cancelled


class PDStaticDiscovery(StaticDiscovery):
    """The static prefill and decode workers of ``pd.prefill`` / ``pd.decode``, with their roles."""

    def __init__(self, config: PDConfig) -> None:
        super().__init__(())
        self._endpoints = [
            Endpoint(name=stable_name(url), url=url, role="prefill", bootstrap_port=port)
            for url, port in config.prefill_workers()
        ] + [Endpoint(name=stable_name(url), url=url, role="decode") for url in config.decode]


class PDDnsDiscovery:
    """PD disaggregation with DNS: the prefill workers' and the decode workers' headless
    Services (``discovery.prefill_dns_name``, ``decode_dns_name``), each resolved as
    ``DnsDiscovery`` resolves one, published together with their roles. A failed lookup keeps
    that role's last known set."""

    def __init__(
        self, config: DiscoveryConfig, pd: PDConfig, resolver: Resolver | None = None
    ) -> None:
        assert config.prefill_dns_name is not None and config.decode_dns_name is not None
        prefill = config.model_copy(update={"dns_name": config.prefill_dns_name})
        decode = config.model_copy(update={"dns_name": config.decode_dns_name})
        self._roles: list[tuple[Role, int | None, DnsDiscovery]] = [
            ("prefill", pd.bootstrap_port, DnsDiscovery(prefill, resolver)),
            ("decode", None, DnsDiscovery(decode, resolver)),
        ]
        self._interval = config.dns_interval_s
        self._known: dict[Role, list[Endpoint]] = {}

    async def resolve(self) -> list[Endpoint]:
        for role, port, dns in self._roles:
            try:
                found = await dns.resolve()
            except OSError as exc:
                log.warning("DNS lookup of %s workers failed (%s); keeping the last set", role, exc)
                continue
            self._known[role] = [replace(e, role=role, bootstrap_port=port) for e in found]
        return [e for endpoints in self._known.values() for e in endpoints]

    async def run(self, publish: Publish) -> None:
        while True:
            publish(await self.resolve())
            await asyncio.sleep(self._interval)


class PDKubernetesDiscovery:
    """PD disaggregation with Kubernetes: the prefill workers' and the decode workers'
    EndpointSlices (``discovery.prefill_label_selector``, ``decode_label_selector``: each role's
    headless Service), each listed and watched as ``KubernetesDiscovery`` does one selector,
    published together with their roles. A prefill worker's bootstrap port is its slice's port
    named ``discovery.bootstrap_port_name``, else ``pd.bootstrap_port``. A pod both selectors
    find (a role label being changed, overlapping selectors) is in neither pool until it is in
    one only: a worker of an unknown role would fail every pair it is in."""

    def __init__(
        self,
        config: DiscoveryConfig,
        pd: PDConfig,
        clients: Mapping[Role, httpx.AsyncClient] | None = None,
    ) -> None:
        assert config.prefill_label_selector is not None
        assert config.decode_label_selector is not None
        clients = clients or {}
        selectors: dict[Role, str] = {
            "prefill": config.prefill_label_selector,
            "decode": config.decode_label_selector,
        }
        self._sources = {
            role: KubernetesDiscovery(
                config.model_copy(update={"label_selector": selector}),
                clients.get(role),
                role=role,
                bootstrap_port=pd.bootstrap_port if role == "prefill" else None,
            )
            for role, selector in selectors.items()
        }
        self._known: dict[Role, list[Endpoint]] = {}
        self._both: set[str] = set()

    def endpoints(self) -> list[Endpoint]:
        """Both pools, less any worker found in both."""
        names = [{e.name for e in found} for found in self._known.values()]
        both = set.intersection(*names) if len(names) == 2 else set()
        if both - self._both:
            log.warning(
                "workers %s are in both the prefill and the decode EndpointSlices; "
                "left out of both pools until they are in one",
                ", ".join(sorted(both - self._both)),
            )
        self._both = both
        return [e for found in self._known.values() for e in found if e.name not in both]

    async def run(self, publish: Publish) -> None:
        def publisher(role: Role) -> Publish:
            def publish_role(endpoints: list[Endpoint]) -> None:
                self._known[role] = endpoints
                publish(self.endpoints())

            return publish_role

        async with asyncio.TaskGroup() as tasks:
            for role, source in self._sources.items():
                tasks.create_task(source.run(publisher(role)))


class Resolver(Protocol):
    async def addresses(self, host: str) -> list[str]: ...

    async def name_of(self, address: str) -> str | None: ...


class SystemResolver:
    """The OS resolver (cluster DNS in a pod), without blocking the event loop."""

    async def addresses(self, host: str) -> list[str]:
        loop = asyncio.get_running_loop()
        infos = await loop.getaddrinfo(host, None, type=socket.SOCK_STREAM)
        return sorted({str(info[4][0]) for info in infos})

    async def name_of(self, address: str) -> str | None:
        loop = asyncio.get_running_loop()
        try:
            hostname, _, _ = await loop.run_in_executor(None, socket.gethostbyaddr, address)
        except OSError:
            return None
        return hostname


class DnsDiscovery:
    """A headless Service's A/AAAA records, re-resolved every ``interval_s``.

    A pod IP changes on restart, so each address is named by its reverse record's first label
    (``dflash-worker-0`` for a StatefulSet pod behind a headless Service) when there is one.
    A failed lookup keeps the last known set rather than emptying the pool.
    """

    def __init__(self, config: DiscoveryConfig, resolver: Resolver | None = None) -> None:
        assert config.dns_name is not None
        self._host = config.dns_name
        self._port = config.dns_port
        self._interval = config.dns_interval_s
        self._resolver = resolver or SystemResolver()

    async def resolve(self) -> list[Endpoint]:
        endpoints = []
        for address in await self._resolver.addresses(self._host):
            reverse = await self._resolver.name_of(address)
            name = reverse.split(".")[0] if reverse else stable_name(_url(address, self._port))
            endpoints.append(Endpoint(name=name, url=_url(address, self._port)))
        return endpoints

    async def run(self, publish: Publish) -> None:
        while True:
            try:
                publish(await self.resolve())
            except OSError as exc:
                log.warning(
                    "DNS lookup of %s failed (%s); keeping the last worker set", self._host, exc
                )
            await asyncio.sleep(self._interval)


class KubernetesDiscovery:
    """EndpointSlices matching a label selector: list, then watch from the list's
    resourceVersion; every ``resync_s`` (or when a watch ends, fails or is too old) list again.

    Endpoint conditions are respected: ready → routable; terminating but still serving →
    draining; anything else is left out. The worker's name is its pod (``targetRef``).
    """

    PATH = "/apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices"

    def __init__(
        self,
        config: DiscoveryConfig,
        client: httpx.AsyncClient | None = None,
        *,
        role: Role = "whole",
        bootstrap_port: int | None = None,
    ) -> None:
        """``role``: every worker found is that PD role's; a prefill worker's bootstrap port is
        its slice's port named ``discovery.bootstrap_port_name``, else ``bootstrap_port``."""
        assert config.api_url is not None
        self._config = config
        self._role: Role = role
        self._bootstrap_port = bootstrap_port
        self._path = self.PATH.format(namespace=config.namespace)
        self._owns_client = client is None
        self._client = client or httpx.AsyncClient(
            base_url=config.api_url,
            verify=str(config.ca_file) if config.ca_file and config.ca_file.exists() else True,
            timeout=httpx.Timeout(10.0, read=config.resync_s + 10.0),
        )
        self._slices: dict[str, dict[str, Any]] = {}

    def _headers(self) -> dict[str, str]:
        token_file: Path | None = self._config.token_file
        # Read on every request: projected service-account tokens rotate.
        if token_file is not None and token_file.exists():
            return {"Authorization": f"Bearer {token_file.read_text().strip()}"}
        return {}

    async def run(self, publish: Publish) -> None:
        try:
            while True:
                try:
                    version = await self._list()
                    publish(self.endpoints())
                    await self._watch(version, publish)
                except (httpx.HTTPError, ValueError) as exc:
                    log.warning("EndpointSlice discovery: %s; re-listing", exc)
                    await asyncio.sleep(1.0)
        finally:  # cancelled at shutdown: close the open watch's connection, not leave it to GC
            if self._owns_client:
                await self._client.aclose()

    async def _list(self) -> str:
        response = await self._client.get(
            self._path,
            params={"labelSelector": self._config.label_selector},
            headers=self._headers(),
        )
        response.raise_for_status()
        body = orjson.loads(response.content)
        self._slices = {item["metadata"]["name"]: item for item in body.get("items", [])}
        return str(body.get("metadata", {}).get("resourceVersion", ""))

    async def _watch(self, version: str, publish: Publish) -> None:
        params = {
            "labelSelector": self._config.label_selector,
            "watch": "1",
            "resourceVersion": version,
            "allowWatchBookmarks": "true",
            "timeoutSeconds": str(max(1, int(self._config.resync_s))),
        }
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self._config.resync_s + 5.0):
                async with self._client.stream(
                    "GET", self._path, params=params, headers=self._headers()
                ) as response:
                    response.raise_for_status()
                    async for line in response.aiter_lines():
                        if line.strip() and not self._apply(orjson.loads(line)):
                            return  # ERROR event (e.g. 410 Gone): list again
                        publish(self.endpoints())

    def _apply(self, event: Mapping[str, Any]) -> bool:
        kind = event.get("type")
        obj = event.get("object") or {}
        if kind == "ERROR":
            log.info("EndpointSlice watch ended: %s", obj.get("message", obj))
            return False
        name = obj.get("metadata", {}).get("name")
        if kind in ("ADDED", "MODIFIED") and name:
            self._slices[name] = dict(obj)
        elif kind == "DELETED" and name:
            self._slices.pop(name, None)
        return True

    def endpoints(self) -> list[Endpoint]:
        found: dict[str, Endpoint] = {}
        for slice_ in self._slices.values():
            ports = slice_.get("ports") or []
            port = self._port(ports)
            if port is None:
                continue
            bootstrap = self._bootstrap(ports) if self._role == "prefill" else None
            for entry in slice_.get("endpoints") or []:
                endpoint = self._endpoint(entry, port)
                if endpoint is not None and self._role != "whole":
                    endpoint = replace(endpoint, role=self._role, bootstrap_port=bootstrap)
                if endpoint is not None and (
                    endpoint.name not in found or found[endpoint.name].draining
                ):
                    found[endpoint.name] = endpoint
        return sorted(found.values(), key=lambda e: e.name)

    def _port(self, ports: Sequence[Mapping[str, Any]]) -> int | None:
        for port in ports:
            if port.get("name") == self._config.port_name and port.get("port"):
                return int(port["port"])
        if len(ports) == 1 and ports[0].get("port"):
            return int(ports[0]["port"])
        return None

    def _bootstrap(self, ports: Sequence[Mapping[str, Any]]) -> int | None:
        for port in ports:
            if port.get("name") == self._config.bootstrap_port_name and port.get("port"):
                return int(port["port"])
        return self._bootstrap_port

    @staticmethod
    def _endpoint(entry: Mapping[str, Any], port: int) -> Endpoint | None:
        addresses = entry.get("addresses") or []
        if not addresses:
            return None
        conditions = entry.get("conditions") or {}
        ready = conditions.get("ready") is not False  # unset means ready (API semantics)
        serving = conditions.get("serving", ready) is not False
        terminating = conditions.get("terminating") is True
        url = _url(str(addresses[0]), port)
        ref = entry.get("targetRef") or {}
        name = ref.get("name") if ref.get("kind") == "Pod" else entry.get("hostname")
        name = str(name) if name else stable_name(url)
        if terminating:
            return Endpoint(name=name, url=url, draining=True) if serving else None
        return Endpoint(name=name, url=url) if ready else None


def make_discovery(
    config: DiscoveryConfig,
    worker_urls: Sequence[str],
    *,
    resolver: Resolver | None = None,
    pd: PDConfig | None = None,
) -> Discovery:
    """The worker source; ``pd``: PD disaggregation is on (its pools: static, by DNS or by
    EndpointSlices)."""
    if pd is not None:
        if config.mode == "dns":
            return PDDnsDiscovery(config, pd, resolver)
        if config.mode == "kubernetes":
            return PDKubernetesDiscovery(config, pd)
        return PDStaticDiscovery(pd)
    if config.mode == "dns":
        return DnsDiscovery(config, resolver)
    if config.mode == "kubernetes":
        return KubernetesDiscovery(config)
    return StaticDiscovery(worker_urls)
