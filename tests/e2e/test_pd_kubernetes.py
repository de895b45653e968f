"""Prefill/decode disaggregation with Kubernetes discovery, with real processes: emulated prefill
and decode workers on loopback, a loopback Kubernetes API serving each role's EndpointSlices, and
``serve --pd-disaggregation`` with ``discovery.mode=kubernetes`` and a label selector per role.
Requests are served by pairs the gateway found in the slices (a wrong bootstrap port would fail
the decode worker's handshake); a decode pod leaving its slice leaves the decode pool; a prefill
pod joining through the watch, its slice without a bootstrap port, takes requests on
``pd.bootstrap_port``."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine, Iterator
from typing import Any, TypeVar

import httpx
import openai
import pytest

from tests.e2e.conftest import FAST_HEALTH, poll
from tests.e2e.test_pd import assert_one_room_each, body, decode, prefill, records
from tests.support.fake_kube import FakeKubeApi, endpoint_slice
from tests.support.procs import PYTHON, ManagedProcess, managed_processes

T = TypeVar("T")
PREFILL = "kimi-prefill"
DECODE = "kimi-decode"


class KubeApiThread:
    """The fake API server on an event loop of its own, so that the test's blocking waits (for
    the gateway to be ready, for its worker table) never stall the gateway's list and watch."""

    def __init__(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    def call(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(10)

    def __enter__(self) -> FakeKubeApi:
        self._thread.start()

        async def start() -> FakeKubeApi:
            return await FakeKubeApi().__aenter__()

        self.api = self.call(start())
        return self.api

    def __exit__(self, *exc: object) -> None:
        self.call(self.api.__aexit__())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        self._loop.close()


def port_of(emu: ManagedProcess) -> int:
    return int(emu.url.rsplit(":", 1)[1])


def served(emu: ManagedProcess) -> int:
    return sum(1 for r in records(emu) if r["outcome"] == "served")


@pytest.fixture
def kube() -> Iterator[KubeApiThread]:
    thread = KubeApiThread()
    with thread:
        yield thread


def test_pools_follow_each_roles_endpointslices(
    kube: KubeApiThread, tmp_path_factory: pytest.TempPathFactory
) -> None:
    api = kube.api
    with managed_processes(tmp_path_factory, "pd-kubernetes") as procs:
        p0, p0_bootstrap = prefill(procs, "prefill-0", "--seed", "1")
        p1, p1_bootstrap = prefill(procs, "prefill-1", "--seed", "2")
        d0 = decode(procs, "decode-0", "--seed", "3")
        d1 = decode(procs, "decode-1", "--seed", "4")
        kube.call(
            api.put(
                endpoint_slice(
                    "kimi-prefill-a",
                    [("kimi-prefill-0", "127.0.0.1")],
                    service=PREFILL,
                    port=port_of(p0),
                    bootstrap_port=p0_bootstrap,
                )
            )
        )
        for name, pod, emu in (("a", "kimi-decode-0", d0), ("b", "kimi-decode-1", d1)):
            kube.call(
                api.put(
                    endpoint_slice(
                        f"kimi-decode-{name}",
                        [(pod, "127.0.0.1")],
                        service=DECODE,
                        port=port_of(emu),
                    )
                )
            )
        # Whole workers' slices in the same namespace belong to neither pool.
        kube.call(api.put(endpoint_slice("w-a", [("dflash-worker-0", "127.0.0.2")])))
        gw = procs.start(
            [PYTHON, "-m", "app", "serve", "--port", "{port}", "--pd-disaggregation"],
            name="gateway",
            ready_path="/readyz",
            ready_status=200,
            env={
                **FAST_HEALTH,
                "DFLASH_GATEWAY_DISCOVERY__MODE": "kubernetes",
                "DFLASH_GATEWAY_DISCOVERY__API_URL": api.url,
                "DFLASH_GATEWAY_DISCOVERY__PREFILL_LABEL_SELECTOR": (
                    f"kubernetes.io/service-name={PREFILL}"
                ),
                "DFLASH_GATEWAY_DISCOVERY__DECODE_LABEL_SELECTOR": (
                    f"kubernetes.io/service-name={DECODE}"
                ),
                # One list per role for the whole test: what follows comes through the watches.
                "DFLASH_GATEWAY_DISCOVERY__RESYNC_S": "600",
                # prefill-1's slice will carry no bootstrap port: this one is its.
                "DFLASH_GATEWAY_PD__BOOTSTRAP_PORT": str(p1_bootstrap),
            },
        )

        def table() -> dict[str, dict[str, Any]]:
            workers = httpx.get(gw.url + "/workers", timeout=5).json()["workers"]
            return {w["name"]: w for w in workers}

        def healthy(names: set[str]) -> bool:
            found = table()
            return set(found) == names and all(w["state"] == "healthy" for w in found.values())

        poll(lambda: healthy({"kimi-prefill-0", "kimi-decode-0", "kimi-decode-1"}), timeout=20)
        workers = table()
        assert {(n, w["role"], w["bootstrap_port"]) for n, w in workers.items()} == {
            ("kimi-prefill-0", "prefill", p0_bootstrap),
            ("kimi-decode-0", "decode", None),
            ("kimi-decode-1", "decode", None),
        }
        assert workers["kimi-prefill-0"]["url"] == p0.url

        client = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0)

        def serve(n: int) -> None:
            for i in range(n):
                chunks = list(client.chat.completions.create(**body(i)))  # type: ignore[call-overload]
                assert any(c.choices and c.choices[0].finish_reason for c in chunks)
                assert len(chunks) > 8  # the decode worker's stream: the handshake worked

        serve(6)
        assert served(d0) + served(d1) == 6
        assert_one_room_each([p0], [d0, d1], 6)

        # kimi-decode-1 goes: its slice is deleted. It leaves the decode pool and takes nothing.
        kube.call(api.delete("kimi-decode-b"))
        poll(lambda: set(table()) == {"kimi-prefill-0", "kimi-decode-0"}, timeout=10)
        before = served(d1), served(d0)
        serve(3)
        assert (served(d1), served(d0)) == (before[0], before[1] + 3)

        # kimi-prefill-1 joins through the watch, on pd.bootstrap_port (its slice names none).
        kube.call(
            api.put(
                endpoint_slice(
                    "kimi-prefill-b",
                    [("kimi-prefill-1", "127.0.0.1")],
                    service=PREFILL,
                    port=port_of(p1),
                )
            )
        )
        poll(lambda: healthy({"kimi-prefill-0", "kimi-prefill-1", "kimi-decode-0"}), timeout=20)
        assert table()["kimi-prefill-1"]["bootstrap_port"] == p1_bootstrap
        serve(4)
        # least_queued takes idle prefill workers in turn: the new one took part, and every
        # request so far used one room on one prefill and one decode worker.
        assert records(p1)
        assert_one_room_each([p0, p1], [d0, d1], 13)
        assert api.lists == 2  # one list per role; everything after came through the watches
