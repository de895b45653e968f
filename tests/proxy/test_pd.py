"""Prefill/decode disaggregation (app/proxy/dispatch/pd.py and pair.py) against scripted prefill
and decode workers on loopback: the pair, its bootstrap fields, a room per attempt, and the
failure handling."""

from __future__ import annotations

import asyncio
import logging
import random
from dataclasses import dataclass, field
from typing import Any

import pytest

from app.config import Settings
from app.errors import SSE_DONE
from app.routing.policies import LeastQueued, RoutingContext
from app.workers.worker import Worker, WorkerLoad, WorkerState
from tests.support.gateway import MODEL, FakeWorker, GatewayHarness, chat_chunks, wait_for

CHAT = "/v1/chat/completions"
BOOTSTRAP = ("bootstrap_host", "bootstrap_port", "bootstrap_room")


def chat(**extra: object) -> dict[str, object]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **extra}


def events(body: bytes) -> list[bytes]:
    return [e + b"\n\n" for e in body.split(b"\n\n") if e]


@dataclass(eq=False)
class FakePrefill(FakeWorker):
    """A prefill worker: answers like a whole one (its text is never the client's)."""

    bootstrap_port: int | None = None
    texts: tuple[str, ...] = ("PREFILL",)
    server_info: dict[str, Any] | None = field(
        default_factory=lambda: {"disaggregation_mode": "prefill"}
    )

    def rooms(self) -> set[int]:
        return {r["bootstrap_room"] for r in self.requests}


@dataclass(eq=False)
class FakeDecode(FakeWorker):
    """A decode worker that, like SGLang's, starts a request only once its prefill worker has
    the request's room (here: received it); until then it waits, counted in ``waiting``."""

    prefills: list[FakePrefill] = field(default_factory=list)
    server_info: dict[str, Any] | None = field(
        default_factory=lambda: {"disaggregation_mode": "decode"}
    )
    waits: bool = True  # False: answers at once (its own failures are the test's subject)
    waiting: int = 0

    async def _play(self, body: dict[str, Any], writer: Any, fails: bool = True) -> bool:
        if not self.waits:
            return await super()._play(body, writer, fails)
        room = body.get("bootstrap_room")
        self.waiting += 1
        try:
            while not any(room in p.rooms() for p in self.prefills if not p.hang):
                await asyncio.sleep(0.002)
        finally:
            self.waiting -= 1
        return await super()._play(body, writer, fails)


def pd_pair(
    prefill: int = 1, decode: int = 1, **kw: Any
) -> tuple[list[FakePrefill], list[FakeDecode]]:
    ps = [FakePrefill(bootstrap_port=9000 + i) for i in range(prefill)]
    ds = [FakeDecode(prefills=ps, **kw) for _ in range(decode)]
    return ps, ds


async def test_a_stream_goes_to_both_with_the_bootstrap_fields_and_the_client_gets_ds() -> None:
    (p,), (d,) = pd_pair()
    async with GatewayHarness([], prefill=[p], decode=[d]) as gw:
        ex = await gw.post(CHAT, chat(stream=True))
        await wait_for(lambda: gw.gateway.proxy.pd.tasks == set())
    assert ex.status == 200
    (sent_p,), (sent_d,) = p.requests, d.requests
    assert sent_p == sent_d  # the same body to both, rid included
    assert sent_d["bootstrap_host"] == "127.0.0.1"
    assert sent_d["bootstrap_port"] == 9000
    assert 0 <= sent_d["bootstrap_room"] < 2**63
    expected = chat_chunks(sent_d["rid"], d.texts)
    assert ex.body == b"".join(c for c in expected if b'"choices":[]' not in c)
    assert b"PREFILL" not in ex.body  # P's answer is read and dropped
    assert not p.aborted and not d.aborted


async def test_a_whole_answer_is_ds_and_ps_is_dropped(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="dflash_gateway.access")
    (p,), (d,) = pd_pair()
    p.texts = ("PREFILL",)
    async with GatewayHarness([], prefill=[p], decode=[d]) as gw:
        ex = await gw.post(CHAT, chat())
    assert ex.status == 200
    assert ex.json()["id"] == d.requests[0]["rid"] == p.requests[0]["rid"]
    assert ex.json()["choices"][0]["message"]["content"] == "Hello!"
    # The access line names both sides of the pair.
    (line,) = [r for r in caplog.records if r.name == "dflash_gateway.access"]
    fields = line.fields  # type: ignore[attr-defined]
    assert (fields["worker"], fields["prefill_worker"]) == (d.name, p.name)


async def test_a_prefill_worker_without_a_port_gets_the_default_bootstrap_port() -> None:
    p = FakePrefill()
    d = FakeDecode(prefills=[p])
    async with GatewayHarness([], prefill=[p], decode=[d], pd={"bootstrap_port": 8998}) as gw:
        ex = await gw.post(CHAT, chat(stream=True))
    assert ex.status == 200
    assert d.requests[0]["bootstrap_port"] == 8998


async def test_every_request_gets_its_own_room() -> None:
    (p,), (d,) = pd_pair()
    async with GatewayHarness([], prefill=[p], decode=[d], rng=random.Random(7)) as gw:
        for _ in range(5):
            assert (await gw.post(CHAT, chat(stream=True))).status == 200
    rooms = [r["bootstrap_room"] for r in d.requests]
    assert len(set(rooms)) == 5
    assert rooms == [r["bootstrap_room"] for r in p.requests]


async def test_a_retry_goes_to_another_pair_with_a_new_room() -> None:
    ps, ds = pd_pair(prefill=1, decode=2)
    settings = {"pd": {"decode_policy": "least_inflight"}}
    async with GatewayHarness([], prefill=ps, decode=ds, **settings) as gw:
        # least_inflight breaks ties by name: the first by name is tried first, and refuses.
        bad, good = sorted(ds, key=lambda w: w.name)
        bad.fail_status = 503
        results = [await gw.post(CHAT, chat(stream=True)) for _ in range(2)]
    assert all(ex.status == 200 and ex.body.endswith(SSE_DONE) for ex in results)
    assert bad.requests and len(good.requests) == 2
    tried = [r["bootstrap_room"] for r in (*bad.requests, *good.requests)]
    assert len(set(tried)) == len(tried)  # a room per attempt
    rids = [r["rid"] for r in (*bad.requests, *good.requests)]
    assert len(set(rids)) == len(rids)
    assert len(ps[0].requests) == len(tried)  # each attempt had its prefill side


async def test_a_prefill_failure_aborts_the_decode_side_and_retries_on_another_prefill() -> None:
    ps, (d,) = pd_pair(prefill=2, decode=1)
    async with GatewayHarness([], prefill=ps, decode=[d]) as gw:
        # The first pick of an idle pool is the first prefill worker listed; it fails and
        # never hands over its room, so the decode side waits for it.
        bad, good = ps
        bad.fail_status, d.prefills = 500, [good]
        ex = await gw.post(CHAT, chat(stream=True))
        await wait_for(lambda: d.waiting == 0)
    assert ex.status == 200 and ex.body.endswith(SSE_DONE)
    first, second = d.requests
    assert first["bootstrap_port"] == bad.bootstrap_port
    assert second["bootstrap_port"] == good.bootstrap_port
    assert first["bootstrap_room"] != second["bootstrap_room"]
    assert d.aborted == [first["rid"]]  # the decode side of the failed pair, by its rid


async def test_a_lone_prefill_failing_fails_fast_and_leaves_no_decode_waiting() -> None:
    (p,), (d,) = pd_pair()
    p.fail_status = 500
    d.prefills = []  # nobody will ever fill the room
    async with GatewayHarness([], prefill=[p], decode=[d]) as gw:
        ex = await gw.post(CHAT, chat(stream=True))
        await wait_for(lambda: d.waiting == 0)
        assert d.aborted == [d.requests[0]["rid"]]
        await wait_for(lambda: all(w.in_flight == 0 for w in gw.gateway.pool.workers))
    assert ex.status == 502
    assert ex.json()["error"]["code"] == "prefill_failed"


async def test_a_decode_failure_aborts_the_prefill_side() -> None:
    (p,), (d,) = pd_pair()
    p.hang = True  # the prefill side is still running when the decode side fails
    d.waits, d.fail_status = False, 400  # D refuses the request: not retried
    async with GatewayHarness([], prefill=[p], decode=[d]) as gw:
        ex = await gw.post(CHAT, chat(stream=True))
        await wait_for(lambda: p.aborted)
        assert p.aborted == [d.requests[0]["rid"]]
        await wait_for(lambda: all(w.in_flight == 0 for w in gw.gateway.pool.workers))
    assert ex.status == 400


async def test_the_first_byte_deadline_covers_the_bootstrap_wait() -> None:
    (p,), (d,) = pd_pair()
    d.prefills = []  # the room never arrives
    async with GatewayHarness([], prefill=[p], decode=[d], timeouts={"first_byte_s": 0.2}) as gw:
        ex = await gw.post(CHAT, chat(stream=True))
        await wait_for(lambda: d.waiting == 0)
        await wait_for(lambda: d.aborted)
        await wait_for(lambda: all(w.in_flight == 0 for w in gw.gateway.pool.workers))
    assert ex.status == 504
    assert d.aborted == [d.requests[0]["rid"]]


async def test_a_client_leaving_aborts_both_sides() -> None:
    (p,), (d,) = pd_pair(hold_after=2)
    p.hang = True  # P still busy
    d.waits = False
    gone = asyncio.Event()
    async with GatewayHarness([], prefill=[p], decode=[d]) as gw:
        task = asyncio.create_task(gw.post(CHAT, chat(stream=True), disconnect=gone))
        await asyncio.wait_for(d.held.wait(), 5)
        gone.set()
        await asyncio.wait_for(task, 5)
        await wait_for(lambda: p.aborted and d.aborted)
        rid = d.requests[0]["rid"]
        assert p.aborted == [rid] and d.aborted == [rid]
        await wait_for(lambda: all(w.in_flight == 0 for w in gw.gateway.pool.workers))


@pytest.mark.parametrize("name", BOOTSTRAP)
async def test_clients_cannot_send_the_bootstrap_fields(name: str) -> None:
    (p,), (d,) = pd_pair()
    async with GatewayHarness([], prefill=[p], decode=[d]) as gw:
        ex = await gw.post(CHAT, chat(stream=True, **{name: 1}))
    assert ex.status == 400
    assert ex.json()["error"]["param"] == name
    assert not p.requests and not d.requests


async def test_whole_workers_get_no_bootstrap_fields() -> None:
    worker = FakeWorker()
    async with GatewayHarness([worker]) as gw:
        assert gw.gateway.proxy.pd is None
        assert (await gw.post(CHAT, chat(stream=True))).status == 200
    assert not set(BOOTSTRAP) & set(worker.requests[0])


async def test_workers_and_metrics_show_the_roles_and_the_kv_wait() -> None:
    (p,), (d,) = pd_pair()
    async with GatewayHarness([], prefill=[p], decode=[d]) as gw:
        assert (await gw.post(CHAT, chat(stream=True))).status == 200
        await wait_for(lambda: gw.gateway.proxy.pd.tasks == set())
        table = (await gw.request("GET", "/workers")).json()
        text = (await gw.request("GET", "/metrics")).body.decode()
    roles = {w["url"]: (w["role"], w["bootstrap_port"]) for w in table["workers"]}
    assert roles == {p.url: ("prefill", 9000), d.url: ("decode", None)}
    assert table["pd"]["prefill_policy"] == "least_queued"
    assert f'dflash_gateway_worker_up{{role="prefill",worker="{p.name}"}} 1.0' in text
    assert f'dflash_gateway_worker_up{{role="decode",worker="{d.name}"}} 1.0' in text
    assert f'dflash_gateway_pd_kv_transfer_wait_seconds_count{{model="{MODEL}"}} 1.0' in text
    # Tokens (and so acceptance length) are the decode worker's.
    assert (
        f'dflash_gateway_completion_tokens_total{{model="{MODEL}",worker="{d.name}"}} 3.0' in text
    )
    assert (
        f'dflash_gateway_completion_tokens_total{{model="{MODEL}",worker="{p.name}"}} 0.0' in text
    )


# Picking (pure functions of the pool, no I/O).


def _worker(name: str, role: str, **load: Any) -> Worker:
    w = Worker(f"http://{name}:1", name=name, role=role)  # type: ignore[arg-type]
    w.state, w.models = WorkerState.HEALTHY, (MODEL,)
    w.set_load(WorkerLoad(**load))
    return w


def test_least_queued_picks_the_fewest_queued_prefill_tokens_then_requests() -> None:
    a = _worker("a", "prefill", waiting_tokens=9000, waiting=1)
    b = _worker("b", "prefill", waiting_tokens=100, waiting=5)
    c = _worker("c", "prefill", waiting_tokens=100, waiting=2)
    ctx = RoutingContext(MODEL)
    policy = LeastQueued()
    assert policy.pick(ctx, [a, b, c]) is c
    c.in_flight = 4  # sent since its poll: counts as queued
    assert policy.pick(ctx, [a, b, c]) is b


def test_least_queued_takes_idle_workers_in_turn() -> None:
    idle = [_worker(name, "prefill") for name in "abc"]
    policy = LeastQueued()
    picks = [policy.pick(RoutingContext(MODEL), idle).name for _ in range(6)]
    assert picks == ["a", "b", "c", "a", "b", "c"]


def test_settings_take_sglang_routers_prefill_form_and_refuse_half_a_fleet() -> None:
    s = Settings(
        pd={
            "disaggregation": True,
            "prefill": "http://p0:30000 8998,http://p1:30000",
            "decode": "http://d0:30000",
            "bootstrap_port": 9100,
        }
    )
    assert s.pd.prefill_workers() == [("http://p0:30000", 8998), ("http://p1:30000", 9100)]
    assert not s.embedded_default
    assert Settings(pd={"disaggregation": True}).embedded_default  # 1 + 1 emulated
    for bad in (
        {"disaggregation": True, "prefill": ["http://p:1"]},
        {"disaggregation": True, "prefill": ["http://p:1 notaport"], "decode": ["http://d:1"]},
        {"disaggregation": True, "prefill": ["http://p:1 1 2"], "decode": ["http://d:1"]},
        {"prefill": ["http://p:1"], "decode": ["http://d:1"]},
    ):
        with pytest.raises(ValueError, match=r"prefill|decode|bootstrap port"):
            Settings(pd=bad)
    with pytest.raises(ValueError, match="worker_urls"):
        Settings(worker_urls=["http://w:1"], pd={"disaggregation": True})
    with pytest.raises(ValueError, match="bootstrap"):
        Settings(pd={"disaggregation": True}, limits={"extra_fields": ["bootstrap_room"]})


async def test_a_decode_worker_is_only_a_candidate_while_a_prefill_worker_is_up() -> None:
    (p,), (d,) = pd_pair()
    async with GatewayHarness([], prefill=[p], decode=[d], health={"interval_s": 0.05}) as gw:
        await p.stop()  # the only prefill worker goes away
        await wait_for(lambda: not gw.gateway.pool.get(p.name).routable, timeout=10)
        ex = await gw.post(CHAT, chat(stream=True))
    assert ex.status == 503
    assert not d.requests


async def test_a_request_the_prefill_worker_refuses_is_refused_not_retried() -> None:
    ps, (d,) = pd_pair(prefill=2, decode=1)
    for p in ps:
        p.fail_status = 400  # the request itself is at fault: any pair would refuse it
    d.prefills = []
    async with GatewayHarness([], prefill=ps, decode=[d]) as gw:
        ex = await gw.post(CHAT, chat(stream=True))
        await wait_for(lambda: d.waiting == 0)
        assert d.aborted == [d.requests[0]["rid"]]
    assert ex.status == 400
    assert ex.json()["error"]["message"] == "The request queue is full."  # the worker's own
    assert len(d.requests) == 1 and sum(len(p.requests) for p in ps) == 1


async def test_a_worker_running_another_role_is_not_admitted() -> None:
    (p,), (d,) = pd_pair()
    wrong = FakeDecode(prefills=[p])  # listed as a decode worker, runs as a prefill one
    wrong.server_info = {"disaggregation_mode": "prefill"}
    settings = {"health": {"interval_s": 0.05}}
    async with GatewayHarness([], prefill=[p], decode=[d, wrong], **settings) as gw:
        await wait_for(lambda: wrong.server_info_served >= 3)  # asked, and asked again
        assert gw.gateway.pool.get(wrong.name).state is not WorkerState.HEALTHY
        assert gw.gateway.pool.get(d.name).state is WorkerState.HEALTHY
        for _ in range(4):
            assert (await gw.post(CHAT, chat(stream=True))).status == 200
    assert not wrong.requests and len(d.requests) == 4


async def test_prefix_affinity_keeps_a_conversation_on_one_prefill_worker() -> None:
    ps, (d,) = pd_pair(prefill=3, decode=1)
    settings = {"pd": {"prefill_policy": "prefix_affinity"}}
    async with GatewayHarness([], prefill=ps, decode=[d], **settings) as gw:
        for session in range(8):
            for _ in range(2):
                headers = {"x-session-id": f"session-{session}"}
                ex = await gw.post(CHAT, chat(stream=True), headers=headers)
                assert ex.status == 200
    by_port = {p.bootstrap_port: p for p in ps}
    homes = []
    for i in range(0, 16, 2):  # each session's two requests, in order
        ports = {sent["bootstrap_port"] for sent in d.requests[i : i + 2]}
        assert len(ports) == 1, (i, ports)  # one prefill worker per conversation
        homes.append(ports.pop())
    for sent in d.requests:  # and that worker did get the pair's room
        assert sent["bootstrap_room"] in by_port[sent["bootstrap_port"]].rooms()
    assert len(set(homes)) > 1  # conversations spread over the pool (8 keys, 3 workers)


def test_loads_give_the_prefill_queue_and_the_transfer_queues() -> None:
    from app.workers.engines import parse_loads

    decode = parse_loads(
        {
            "loads": [
                {
                    "num_running_reqs": 12,
                    "num_waiting_reqs": 1,
                    "disaggregation": {
                        "mode": "decode",
                        "decode_prealloc_queue_reqs": 3,
                        "decode_transfer_queue_reqs": 4,
                    },
                }
            ]
        }
    )
    prefill = parse_loads(
        {
            "loads": [
                {
                    "num_waiting_reqs": 2,
                    "num_waiting_uncached_tokens": 5000,
                    "disaggregation": {
                        "prefill_bootstrap_queue_reqs": 1,
                        "prefill_inflight_queue_reqs": 2,
                        "decode_transfer_queue_reqs": -5,  # implausible: not counted
                    },
                }
            ]
        }
    )
    assert decode is not None and prefill is not None
    assert (decode.running, decode.transfer_queue) == (12, 7)
    assert (prefill.waiting, prefill.waiting_tokens, prefill.transfer_queue) == (2, 5000, 3)
    whole = parse_loads({"loads": [{"num_running_reqs": 1}]})
    assert whole is not None and whole.transfer_queue == 0


def test_fleet_saturation_counts_the_decode_pool_only() -> None:
    from app.workers.admission import Admission
    from app.workers.config import AdmissionConfig

    prefill = _worker("p", "prefill", running=40, max_running_requests=48)
    decode = _worker("d", "decode", running=12, max_running_requests=48)
    assert Admission(AdmissionConfig()).saturation([prefill, decode]) == 12 / 48


async def test_a_continuation_legs_prefill_failure_aborts_its_decode_side() -> None:
    ps, ds = pd_pair(prefill=2, decode=2)
    # A first-byte deadline (which would end the wait anyway) far beyond wait_for's 5 s.
    settings = {"pd": {"decode_policy": "least_inflight"}, "timeouts": {"first_byte_s": 20}}
    async with GatewayHarness([], prefill=ps, decode=ds, **settings) as gw:
        first_p, second_p = ps  # least_queued takes idle prefill workers in turn
        first_d, second_d = sorted(ds, key=lambda w: w.name)  # least_inflight: ties by name
        first_d.die_after = 3  # the stream breaks after the commit point: a continuation
        second_p.fail_status = 500  # the continuation's prefill side fails...
        second_d.prefills = [first_p]  # ...and never hands over its room
        task = asyncio.create_task(gw.post(CHAT, chat(stream=True)))
        # Released by the gateway's abort while the request runs, not by its deadline.
        await wait_for(lambda: second_d.requests and second_d.waiting == 0)
        assert second_d.aborted == [second_d.requests[0]["rid"]]
        ex = await asyncio.wait_for(task, 5)
        await wait_for(lambda: all(w.in_flight == 0 for w in gw.gateway.pool.workers))
    assert ex.status == 200 and ex.body.endswith(SSE_DONE)
    assert second_d.requests[0]["bootstrap_port"] == second_p.bootstrap_port
    assert second_d.requests[0]["bootstrap_room"] != first_d.requests[0]["bootstrap_room"]


async def test_a_prefill_worker_that_never_answers_is_blamed_not_the_decode_worker() -> None:
    # The first prefill worker takes the request and never answers (its room is never filled):
    # the decode side's deadline passes. That is the prefill worker's timeout: the request is
    # retried on the same decode worker with the other prefill worker, and only the silent one
    # is counted against (a decode pool's breakers are not opened by one bad prefill worker).
    ps, (d,) = pd_pair(prefill=2, decode=1)
    bad, good = ps
    bad.hang = True
    async with GatewayHarness([], prefill=ps, decode=[d], timeouts={"first_byte_s": 0.3}) as gw:
        ex = await gw.post(CHAT, chat(stream=True))
        await wait_for(lambda: all(w.in_flight == 0 for w in gw.gateway.pool.workers))
        registry = gw.gateway.metrics.registry

        def attempts(worker: FakeWorker, outcome: str) -> float | None:
            labels = {"worker": worker.name, "outcome": outcome}
            return registry.get_sample_value("dflash_gateway_upstream_attempts_total", labels)

        assert (attempts(d, "timeout"), attempts(bad, "timeout")) == (0.0, 1.0)
    assert ex.status == 200 and ex.body.endswith(SSE_DONE)
    first, second = d.requests
    assert (first["bootstrap_port"], second["bootstrap_port"]) == (
        bad.bootstrap_port,
        good.bootstrap_port,
    )
    assert d.aborted == [first["rid"]] and bad.aborted == [first["rid"]]


async def test_a_prefill_worker_that_never_finishes_is_let_go_soon_and_then_marked_down() -> None:
    # The prefill worker takes every request and never answers while the decode worker answers
    # at once: each client gets its whole answer, and the prefill side is aborted on P, its
    # connection closed and its in-flight slot freed pd.prefill_drain_s after it (not after
    # timeouts.first_byte_s, 300 s), counted as P's timeout; after breaker.failure_threshold of
    # them P is out of rotation, so it no longer takes (and leaks) requests.
    (p,), (d,) = pd_pair(waits=False)
    p.hang = True
    settings: dict[str, Any] = {
        "pd": {"prefill_drain_s": 0.2},
        "breaker": {"failure_threshold": 3, "open_s": 60},
    }
    async with GatewayHarness([], prefill=[p], decode=[d], **settings) as gw:
        (prefill,) = [w for w in gw.gateway.pool.workers if w.name == p.name]
        registry = gw.gateway.metrics.registry
        for n in range(1, 4):
            p.closed.clear()
            ex = await gw.post(CHAT, chat(stream=True))
            assert ex.status == 200 and ex.body.endswith(SSE_DONE)
            await wait_for(
                lambda n=n: (
                    len(p.aborted) == n  # type: ignore[misc]
                    and p.closed.is_set()
                    and prefill.in_flight == 0
                    and not gw.gateway.proxy.pd.tasks
                ),
                timeout=4,
            )
        assert p.aborted == [r["rid"] for r in p.requests]
        labels = {"worker": p.name, "outcome": "timeout"}
        assert registry.get_sample_value("dflash_gateway_upstream_attempts_total", labels) == 3.0
        assert not prefill.routable
        ex = await gw.post(CHAT, chat(stream=True))
    assert ex.status == 503  # no prefill worker left to pair with
    assert len(p.requests) == 3 and len(d.requests) == 3
