from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from app.config import DiscoveryConfig
from app.workers.discovery import (
    DnsDiscovery,
    Endpoint,
    KubernetesDiscovery,
    StaticDiscovery,
    make_discovery,
)
from tests.support.fake_kube import FakeKubeApi, endpoint_slice


class Snapshots:
    def __init__(self) -> None:
        self.latest: list[Endpoint] | None = None
        self.count = 0

    def __call__(self, endpoints: list[Endpoint]) -> None:
        self.latest = endpoints
        self.count += 1

    def names(self) -> set[str]:
        return {e.name for e in self.latest or []}

    async def until(self, predicate: Callable[[], bool], timeout: float = 10.0) -> None:
        async with asyncio.timeout(timeout):
            while not predicate():
                await asyncio.sleep(0.02)


async def _stop(task: asyncio.Task[None]) -> None:
    """Cancel a discovery loop and wait for it to clean up (its watch connection included)."""
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    assert task.cancelled()


async def test_static_publishes_the_configured_urls_once() -> None:
    seen = Snapshots()
    task = asyncio.create_task(StaticDiscovery(["http://a:30000", "http://b:1"]).run(seen))
    await seen.until(lambda: seen.latest is not None)
    assert [(e.name, e.url) for e in seen.latest or []] == [
        ("a:30000", "http://a:30000"),
        ("b:1", "http://b:1"),
    ]
    await _stop(task)


class FakeResolver:
    def __init__(self) -> None:
        self.records: list[str] = []
        self.names: dict[str, str] = {}
        self.fail = False

    async def addresses(self, host: str) -> list[str]:
        if self.fail:
            raise OSError("SERVFAIL")
        return list(self.records)

    async def name_of(self, address: str) -> str | None:
        return self.names.get(address)


async def test_dns_names_workers_by_reverse_record_and_follows_changes() -> None:
    resolver = FakeResolver()
    resolver.records = ["10.0.0.5", "10.0.0.6"]
    resolver.names = {"10.0.0.5": "dflash-worker-0.dflash-workers.ns.svc.cluster.local"}
    config = DiscoveryConfig(mode="dns", dns_name="dflash-workers", dns_interval_s=0.05)
    seen = Snapshots()
    task = asyncio.create_task(DnsDiscovery(config, resolver).run(seen))
    try:
        await seen.until(lambda: seen.names() == {"dflash-worker-0", "10.0.0.6:30000"})
        assert {e.url for e in seen.latest or []} == {
            "http://10.0.0.5:30000",
            "http://10.0.0.6:30000",
        }
        resolver.fail = True  # a failed lookup must not empty the pool
        before = seen.count
        await asyncio.sleep(0.2)
        assert seen.count == before
        resolver.fail = False
        resolver.records = ["10.0.0.6", "fd00::7"]
        await seen.until(lambda: "[fd00::7]:30000" in seen.names())
        assert "http://[fd00::7]:30000" in {e.url for e in seen.latest or []}
    finally:
        await _stop(task)


@pytest.fixture
async def kube() -> AsyncIterator[FakeKubeApi]:
    async with FakeKubeApi() as api:
        yield api


def _config(api: FakeKubeApi, tmp_path: Path, resync_s: float = 1.0) -> DiscoveryConfig:
    token = tmp_path / "token"
    token.write_text("sa-token-1\n")
    return DiscoveryConfig(
        mode="kubernetes",
        api_url=api.url,
        token_file=token,
        ca_file=None,
        resync_s=resync_s,
        label_selector="kubernetes.io/service-name=dflash-workers",
    )


async def test_endpointslices_list_watch_and_conditions(kube: FakeKubeApi, tmp_path: Path) -> None:
    await kube.put(
        endpoint_slice("w-a", [("dflash-worker-0", "10.1.0.1"), ("dflash-worker-1", "10.1.0.2")])
    )
    await kube.put(endpoint_slice("other", [("unrelated", "10.9.9.9")], service="something-else"))
    seen = Snapshots()
    task = asyncio.create_task(KubernetesDiscovery(_config(kube, tmp_path, 30)).run(seen))
    try:
        await seen.until(lambda: seen.names() == {"dflash-worker-0", "dflash-worker-1"})
        assert {e.url for e in seen.latest or []} == {
            "http://10.1.0.1:30000",
            "http://10.1.0.2:30000",
        }
        # A new worker still loading (not ready) gets no traffic; once ready it joins.
        await kube.put(endpoint_slice("w-b", [("dflash-worker-2", "10.1.0.3")], ready=False))
        await asyncio.sleep(0.2)
        assert "dflash-worker-2" not in seen.names()
        await kube.put(endpoint_slice("w-b", [("dflash-worker-2", "10.1.0.3")]))
        await seen.until(lambda: "dflash-worker-2" in seen.names())
        # Terminating but serving: drained, not dropped.
        await kube.put(
            endpoint_slice(
                "w-b",
                [("dflash-worker-2", "10.1.0.3")],
                ready=False,
                terminating=True,
                serving=True,
            )
        )
        await seen.until(lambda: any(e.draining for e in seen.latest or []))
        assert [e.name for e in seen.latest or [] if e.draining] == ["dflash-worker-2"]
        await kube.delete("w-b")
        await seen.until(lambda: seen.names() == {"dflash-worker-0", "dflash-worker-1"})
        assert kube.lists == 1  # all of that came through the watch
        assert set(kube.tokens_seen) == {"Bearer sa-token-1"}
    finally:
        await _stop(task)


async def test_missed_delete_is_healed_by_the_periodic_relist(
    kube: FakeKubeApi, tmp_path: Path
) -> None:
    await kube.put(endpoint_slice("w-a", [("dflash-worker-0", "10.1.0.1")]))
    await kube.put(endpoint_slice("w-b", [("dflash-worker-1", "10.1.0.2")]))
    seen = Snapshots()
    task = asyncio.create_task(KubernetesDiscovery(_config(kube, tmp_path, 1.0)).run(seen))
    try:
        await seen.until(lambda: seen.names() == {"dflash-worker-0", "dflash-worker-1"})
        await kube.delete("w-b", missed=True)
        # The watch never reports it; the re-list within resync_s must drop the zombie.
        await seen.until(lambda: seen.names() == {"dflash-worker-0"}, timeout=10)
        assert kube.lists >= 2
    finally:
        await _stop(task)


async def test_watch_ended_by_the_server_relists(kube: FakeKubeApi, tmp_path: Path) -> None:
    await kube.put(endpoint_slice("w-a", [("dflash-worker-0", "10.1.0.1")]))
    seen = Snapshots()
    task = asyncio.create_task(KubernetesDiscovery(_config(kube, tmp_path, 30)).run(seen))
    try:
        await seen.until(lambda: seen.names() == {"dflash-worker-0"})
        await kube.delete("w-a", missed=True)
        await kube.put(endpoint_slice("w-c", [("dflash-worker-5", "10.1.0.9")]))
        await seen.until(lambda: "dflash-worker-5" in seen.names())
        assert "dflash-worker-0" in seen.names()  # the zombie the lost event left behind
        await kube.compact()  # API server restart: open watches end, old versions are gone
        await seen.until(lambda: seen.names() == {"dflash-worker-5"})
        assert kube.lists == 2
    finally:
        await _stop(task)


async def test_gone_watch_version_relists(kube: FakeKubeApi, tmp_path: Path) -> None:
    await kube.put(endpoint_slice("w-a", [("dflash-worker-0", "10.1.0.1")]))
    await kube.compact()
    kube.oldest_watchable = 10**9  # every watch is answered with 410 Gone
    seen = Snapshots()
    task = asyncio.create_task(KubernetesDiscovery(_config(kube, tmp_path, 30)).run(seen))
    try:
        await seen.until(lambda: kube.lists >= 3)
        assert seen.names() == {"dflash-worker-0"}
        assert kube.watches >= 2
    finally:
        await _stop(task)


def test_make_discovery_picks_the_configured_source() -> None:
    assert isinstance(make_discovery(DiscoveryConfig(), ["http://a:1"]), StaticDiscovery)
    dns = DiscoveryConfig(mode="dns", dns_name="w")
    assert isinstance(make_discovery(dns, []), DnsDiscovery)


class RoleResolver(FakeResolver):
    """Each headless Service its own records."""

    def __init__(self) -> None:
        super().__init__()
        self.by_host: dict[str, list[str]] = {}
        self.failing: set[str] = set()

    async def addresses(self, host: str) -> list[str]:
        if host in self.failing:
            raise OSError("SERVFAIL")
        return list(self.by_host.get(host, []))


async def test_pd_dns_publishes_each_pools_workers_with_their_roles() -> None:
    from app.config import PDConfig

    resolver = RoleResolver()
    resolver.by_host = {"prefill": ["10.0.0.5"], "decode": ["10.0.1.5", "10.0.1.6"]}
    resolver.names = {"10.0.0.5": "kimi-prefill-0.kimi-prefill.llm.svc.cluster.local"}
    config = DiscoveryConfig(
        mode="dns", prefill_dns_name="prefill", decode_dns_name="decode", dns_interval_s=0.05
    )
    pd = PDConfig(disaggregation=True, bootstrap_port=9000)
    seen = Snapshots()
    task = asyncio.create_task(make_discovery(config, [], resolver=resolver, pd=pd).run(seen))
    try:
        await seen.until(lambda: len(seen.names()) == 3)
        roles = {(e.name, e.role, e.bootstrap_port) for e in seen.latest or []}
        assert roles == {
            ("kimi-prefill-0", "prefill", 9000),
            ("10.0.1.5:30000", "decode", None),
            ("10.0.1.6:30000", "decode", None),
        }
        resolver.failing = {"decode"}  # one pool's lookup fails: its last set is kept
        resolver.by_host["prefill"] = ["10.0.0.5", "10.0.0.7"]
        await seen.until(lambda: len(seen.names()) == 4)
        assert {e.role for e in seen.latest or []} == {"prefill", "decode"}
    finally:
        await _stop(task)


def test_pd_settings_take_static_lists_or_both_dns_names() -> None:
    from app.config import Settings

    dns = {"mode": "dns", "prefill_dns_name": "p", "decode_dns_name": "d"}
    settings = Settings(pd={"disaggregation": True}, discovery=dns)
    assert not settings.embedded_default
    with pytest.raises(ValueError, match=r"prefill_dns_name and discovery\.decode_dns_name"):
        Settings(pd={"disaggregation": True}, discovery={"mode": "dns", "dns_name": "w"})
    with pytest.raises(ValueError, match=r"need pd\.disaggregation"):
        Settings(discovery=dns)
    with pytest.raises(ValueError, match="static or dns"):
        Settings(
            pd={"disaggregation": True}, discovery={"mode": "kubernetes", "api_url": "http://k"}
        )
