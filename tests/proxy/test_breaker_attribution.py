"""One client cannot open the workers' circuit breakers for everyone: a worker's 5xx answers to
one API key's requests (SGLang answers 500 to some bad input) leave the breakers closed and the
other keys served, while a worker that fails the requests of several keys still has its breaker
opened (``app.workers.breaker``)."""

from __future__ import annotations

from app.workers.breaker import BreakerState
from tests.support.gateway import MODEL, FakeWorker, GatewayHarness

CHAT = "/v1/chat/completions"
KEY_A = "sk-tenant-a-0123456789abcdef"
KEY_B = "sk-tenant-b-0123456789abcdef"
KEYS = [f"a:{KEY_A}", f"b:{KEY_B}"]


def chat(text: str) -> dict[str, object]:
    return {"model": MODEL, "messages": [{"role": "user", "content": text}]}


def auth(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


async def test_ten_bad_requests_from_one_key_do_not_fail_another_keys() -> None:
    workers = [FakeWorker(fail_status=500, fail_marker=b"POISON") for _ in range(2)]
    async with GatewayHarness(workers, api_keys=KEYS) as gw:
        for _ in range(10):
            bad = await gw.post(CHAT, chat("POISON"), headers=auth(KEY_A))
            assert bad.status == 500
        states = [w.breaker.state for w in gw.gateway.pool.workers]
        assert states == [BreakerState.CLOSED] * 2
        for _ in range(4):
            good = await gw.post(CHAT, chat("hello"), headers=auth(KEY_B))
            assert good.status == 200, good.body
    assert sum(len(w.requests) for w in workers) == 14


async def test_a_worker_that_fails_every_keys_requests_is_still_cut_off() -> None:
    broken = FakeWorker(fail_status=500)
    async with GatewayHarness([broken], api_keys=KEYS) as gw:
        [worker] = gw.gateway.pool.workers
        for i in range(5):  # the default threshold: 5 failures, from two keys
            failed = await gw.post(CHAT, chat("hello"), headers=auth(KEY_A if i % 2 else KEY_B))
            assert failed.status == 500
        assert worker.breaker.state is BreakerState.OPEN
        refused = await gw.post(CHAT, chat("hello"), headers=auth(KEY_A))
    assert refused.status == 503
    assert len(broken.requests) == 5


async def test_without_keys_a_worker_answering_500_is_cut_off_as_before() -> None:
    broken, sound = FakeWorker(fail_status=500), FakeWorker()
    async with GatewayHarness([broken, sound], policy="round_robin") as gw:
        [bad] = [w for w in gw.gateway.pool.workers if w.url == broken.url]
        for _ in range(20):
            await gw.post(CHAT, chat("hello"))
            if bad.breaker.state is BreakerState.OPEN:
                break
        assert bad.breaker.state is BreakerState.OPEN
