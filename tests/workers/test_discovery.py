from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from app.workers.config import DiscoveryConfig
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
    from app.workers.config import PDConfig

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
    with pytest.raises(ValueError, match=r"prefill_label_selector and discovery\.decode_label"):
        Settings(
            pd={"disaggregation": True}, discovery={"mode": "kubernetes", "api_url": "http://k"}
        )
    by_selector = {
        "mode": "kubernetes",
        "api_url": "http://k",
        "prefill_label_selector": "kubernetes.io/service-name=p",
        "decode_label_selector": "kubernetes.io/service-name=d",
    }
    settings = Settings(pd={"disaggregation": True}, discovery=by_selector)
    assert not settings.embedded_default
    with pytest.raises(ValueError, match=r"decode_label_selector need pd\.disaggregation"):
        Settings(discovery=by_selector)
    with pytest.raises(ValueError, match="static discovery's"):
        Settings(
            pd={"disaggregation": True, "prefill": ["http://p:1"], "decode": ["http://d:1"]},
            discovery=by_selector,
        )


PREFILL = "kubernetes.io/service-name=kimi-prefill"
DECODE = "kubernetes.io/service-name=kimi-decode"


def _pd_config(api: FakeKubeApi, tmp_path: Path, resync_s: float = 30.0) -> DiscoveryConfig:
    return _config(api, tmp_path, resync_s).model_copy(
        update={"prefill_label_selector": PREFILL, "decode_label_selector": DECODE}
    )


def _roles(seen: Snapshots) -> set[tuple[str, str, str, int | None]]:
    return {(e.name, e.url, e.role, e.bootstrap_port) for e in seen.latest or []}


async def test_pd_endpointslices_give_each_pool_its_role_and_bootstrap_port(
    kube: FakeKubeApi, tmp_path: Path
) -> None:
    from app.workers.config import PDConfig

    await kube.put(
        endpoint_slice(
            "kimi-prefill-abc",
            [("kimi-prefill-0", "10.2.0.1"), ("kimi-prefill-1", "10.2.0.2")],
            service="kimi-prefill",
            bootstrap_port=8999,
        )
    )
    await kube.put(
        endpoint_slice("kimi-decode-abc", [("kimi-decode-0", "10.3.0.1")], service="kimi-decode")
    )
    # Whole workers of the same namespace belong to neither pool.
    await kube.put(endpoint_slice("w-a", [("dflash-worker-0", "10.1.0.1")]))
    pd = PDConfig(disaggregation=True, bootstrap_port=9000)
    seen = Snapshots()
    task = asyncio.create_task(make_discovery(_pd_config(kube, tmp_path), [], pd=pd).run(seen))
    try:
        await seen.until(lambda: len(seen.names()) == 3)
        assert _roles(seen) == {
            ("kimi-prefill-0", "http://10.2.0.1:30000", "prefill", 8999),
            ("kimi-prefill-1", "http://10.2.0.2:30000", "prefill", 8999),
            ("kimi-decode-0", "http://10.3.0.1:30000", "decode", None),
        }
        # A prefill slice without a port named bootstrap: pd.bootstrap_port.
        await kube.put(
            endpoint_slice(
                "kimi-prefill-def", [("kimi-prefill-2", "10.2.0.3")], service="kimi-prefill"
            )
        )
        await seen.until(lambda: "kimi-prefill-2" in seen.names())
        assert ("kimi-prefill-2", "http://10.2.0.3:30000", "prefill", 9000) in _roles(seen)
        # A decode pod that joins through the watch joins the decode pool only.
        await kube.put(
            endpoint_slice(
                "kimi-decode-abc",
                [("kimi-decode-0", "10.3.0.1"), ("kimi-decode-1", "10.3.0.2")],
                service="kimi-decode",
            )
        )
        await seen.until(lambda: "kimi-decode-1" in seen.names())
        by_role = {
            role: {n for n, _, r, _ in _roles(seen) if r == role} for role in ("prefill", "decode")
        }
        assert by_role == {
            "prefill": {"kimi-prefill-0", "kimi-prefill-1", "kimi-prefill-2"},
            "decode": {"kimi-decode-0", "kimi-decode-1"},
        }
        assert kube.lists == 2  # one list per role, the rest came through the watches
        assert kube.watches >= 2
    finally:
        await _stop(task)


async def test_pd_pod_leaving_its_slice_leaves_its_pool(kube: FakeKubeApi, tmp_path: Path) -> None:
    from app.workers.config import PDConfig
    from app.workers.pool import WorkerPool

    await kube.put(
        endpoint_slice(
            "kimi-prefill-abc",
            [("kimi-prefill-0", "10.2.0.1"), ("kimi-prefill-1", "10.2.0.2")],
            service="kimi-prefill",
            bootstrap_port=8999,
        )
    )
    await kube.put(
        endpoint_slice(
            "kimi-decode-abc",
            [("kimi-decode-0", "10.3.0.1"), ("kimi-decode-1", "10.3.0.2")],
            service="kimi-decode",
        )
    )
    pool = WorkerPool()
    seen = Snapshots()

    def publish(endpoints: list[Endpoint]) -> None:
        seen(endpoints)
        pool.reconcile(endpoints)

    pd = PDConfig(disaggregation=True)
    task = asyncio.create_task(make_discovery(_pd_config(kube, tmp_path), [], pd=pd).run(publish))
    try:
        await seen.until(lambda: len(pool.workers) == 4)
        # kimi-prefill-1 is deleted: its slice no longer lists it.
        await kube.put(
            endpoint_slice(
                "kimi-prefill-abc",
                [("kimi-prefill-0", "10.2.0.1")],
                service="kimi-prefill",
                bootstrap_port=8999,
            )
        )
        await seen.until(lambda: "kimi-prefill-1" not in seen.names())
        assert {(w.name, w.role) for w in pool.workers} == {
            ("kimi-prefill-0", "prefill"),
            ("kimi-decode-0", "decode"),
            ("kimi-decode-1", "decode"),
        }
        # A decode pod terminating is drained in the decode pool, the prefill pool untouched.
        await kube.put(
            endpoint_slice(
                "kimi-decode-abc", [("kimi-decode-0", "10.3.0.1")], service="kimi-decode"
            )
        )
        await kube.put(
            endpoint_slice(
                "kimi-decode-term",
                [("kimi-decode-1", "10.3.0.2")],
                service="kimi-decode",
                ready=False,
                terminating=True,
                serving=True,
            )
        )
        await seen.until(lambda: any(e.draining for e in seen.latest or []))
        assert [(e.name, e.role) for e in seen.latest or [] if e.draining] == [
            ("kimi-decode-1", "decode")
        ]
        # The decode slice goes: the decode pool is empty, the prefill pool is as it was.
        await kube.delete("kimi-decode-abc")
        await kube.delete("kimi-decode-term")
        await seen.until(lambda: seen.names() == {"kimi-prefill-0"})
        assert [(w.name, w.role, w.bootstrap_port) for w in pool.workers] == [
            ("kimi-prefill-0", "prefill", 8999)
        ]
    finally:
        await _stop(task)


async def test_pd_pools_never_mix(kube: FakeKubeApi, tmp_path: Path) -> None:
    """A pod both selectors find (its role label changed while the old slice still lists it)
    joins neither pool until it is in one; a decode slice's bootstrap port is never read."""
    from app.workers.config import PDConfig

    await kube.put(
        endpoint_slice(
            "kimi-prefill-abc",
            [("kimi-prefill-0", "10.2.0.1"), ("kimi-x-0", "10.2.0.9")],
            service="kimi-prefill",
            bootstrap_port=8999,
        )
    )
    # A decode Service that (wrongly) exposes a bootstrap port too.
    await kube.put(
        endpoint_slice(
            "kimi-decode-abc",
            [("kimi-decode-0", "10.3.0.1"), ("kimi-x-0", "10.2.0.9")],
            service="kimi-decode",
            bootstrap_port=8999,
        )
    )
    pd = PDConfig(disaggregation=True)
    seen = Snapshots()
    task = asyncio.create_task(make_discovery(_pd_config(kube, tmp_path), [], pd=pd).run(seen))
    try:
        await seen.until(lambda: seen.names() == {"kimi-prefill-0", "kimi-decode-0"})
        assert _roles(seen) == {
            ("kimi-prefill-0", "http://10.2.0.1:30000", "prefill", 8999),
            ("kimi-decode-0", "http://10.3.0.1:30000", "decode", None),
        }
        # The prefill slice lets go of it: it is a decode worker now.
        await kube.put(
            endpoint_slice(
                "kimi-prefill-abc",
                [("kimi-prefill-0", "10.2.0.1")],
                service="kimi-prefill",
                bootstrap_port=8999,
            )
        )
        await seen.until(lambda: "kimi-x-0" in seen.names())
        assert ("kimi-x-0", "http://10.2.0.9:30000", "decode", None) in _roles(seen)
        assert len(seen.latest or []) == 3
    finally:
        await _stop(task)
