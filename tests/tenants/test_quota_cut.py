"""A stream that ends before its usage chunk (the client hung up, the worker died) still spends
its key's token quota: the tokens the client got are estimated from what was relayed, so cutting
streams short is no way around a quota. The same holds off-stream: a whole answer the client hangs
up on is charged for the time its worker spent on it, one without ``usage`` for its size."""

from __future__ import annotations

import asyncio
from pathlib import Path

import orjson

from app.tenants.config import TenantPolicy, TenantsConfig
from tests.support.gateway import MODEL, FakeWorker, GatewayHarness, wait_for

CHAT = "/v1/chat/completions"
SECRET = "sk-team-0123456789abcdef"
AUTH = {"authorization": f"Bearer {SECRET}"}


def chat(**extra: object) -> dict[str, object]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **extra}


def harness(worker: FakeWorker) -> GatewayHarness:
    tenants = TenantsConfig(keys={"team": TenantPolicy(tokens_per_min=40)})
    return GatewayHarness([worker], api_keys=[f"team:{SECRET}"], tenants=tenants)


async def test_a_stream_the_client_cuts_before_its_usage_chunk_is_charged() -> None:
    # 60 text events, then the worker holds before its finish and usage chunks.
    worker = FakeWorker(texts=("tok",) * 60, hold_after=61)
    async with harness(worker) as gw:
        gone = asyncio.Event()
        task = asyncio.create_task(gw.post(CHAT, chat(stream=True), headers=AUTH, disconnect=gone))
        await asyncio.wait_for(worker.held.wait(), 5)
        gone.set()  # the client has every token it wanted and hangs up
        ex = await asyncio.wait_for(task, 5)
        assert ex.status == 200 and not ex.complete
        assert gw.server is not None
        state = gw.server.server_state
        await wait_for(lambda: not state.tasks)  # the cut request's answer has ended
        refused = await gw.post(CHAT, chat(), headers=AUTH)
    assert refused.status == 429
    assert "40 tokens per minute" in refused.json()["error"]["message"]


async def test_a_stream_whose_worker_dies_before_its_usage_chunk_is_charged() -> None:
    worker = FakeWorker(texts=("tok",) * 60, die_after=61)
    async with harness(worker) as gw:
        cut = await gw.post(CHAT, chat(stream=True), headers=AUTH)
        assert cut.status == 200 and b"tok" in cut.body
        refused = await gw.post(CHAT, chat(), headers=AUTH)
    assert refused.status == 429


async def test_a_whole_answer_the_client_hangs_up_on_is_charged() -> None:
    """Off-stream nothing is relayed before the answer is done: the worker's time on it is
    charged (at least 0.3 s of decoding at the nominal speed: over the 40-token quota)."""
    worker = FakeWorker(hang=True)
    async with harness(worker) as gw:
        gone = asyncio.Event()
        task = asyncio.create_task(gw.post(CHAT, chat(), headers=AUTH, disconnect=gone))
        await wait_for(lambda: worker.requests)
        await asyncio.sleep(0.3)
        gone.set()
        ex = await asyncio.wait_for(task, 5)
        assert ex.status == 0  # hung up before any answer
        await wait_for(lambda: worker.aborted)
        assert gw.server is not None
        state = gw.server.server_state
        await wait_for(lambda: not state.tasks)  # the cut request's answer has ended
        worker.hang = False
        refused = await gw.post(CHAT, chat(), headers=AUTH)
    assert refused.status == 429
    assert "40 tokens per minute" in refused.json()["error"]["message"]


async def test_the_charge_for_a_cut_whole_answer_is_bounded_by_max_tokens() -> None:
    """A request bounded to 1 token costs its prompt and that token, however long it ran."""
    worker = FakeWorker(hang=True)
    tenants = TenantsConfig(keys={"team": TenantPolicy(tokens_per_min=60)})
    async with GatewayHarness([worker], api_keys=[f"team:{SECRET}"], tenants=tenants) as gw:
        gone = asyncio.Event()
        task = asyncio.create_task(gw.post(CHAT, chat(max_tokens=1), headers=AUTH, disconnect=gone))
        await wait_for(lambda: worker.requests)
        await asyncio.sleep(0.5)  # 125 tokens at the nominal speed, were it unbounded
        gone.set()
        await asyncio.wait_for(task, 5)
        assert gw.server is not None
        state = gw.server.server_state
        await wait_for(lambda: not state.tasks)
        worker.hang = False
        served = await gw.post(CHAT, chat(), headers=AUTH)
    assert served.status == 200
    assert 0 < 60 - int(served.headers["x-ratelimit-remaining-tokens"]) < 60


async def test_a_whole_answer_without_usage_is_charged_for_its_size() -> None:
    worker = FakeWorker(usage=False)
    async with harness(worker) as gw:
        first = await gw.post(CHAT, chat(), headers=AUTH)
        assert first.status == 200 and "usage" not in first.json()
        refused = await gw.post(CHAT, chat(), headers=AUTH)
    assert refused.status == 429


async def test_the_usage_log_records_the_estimate_a_cut_stream_was_charged(tmp_path: Path) -> None:
    """A stream the client reads to its end, whose worker dies before the usage chunk: its usage
    line holds the tokens its key was charged, flagged ``usage_estimated``, not zeros; a stream
    with usage is logged as the worker counted it."""
    log_path = tmp_path / "usage.jsonl"
    tenants = TenantsConfig(keys={"team": TenantPolicy(tokens_per_min=100_000)}, usage_log=log_path)
    worker = FakeWorker(texts=("tok",) * 60, die_after=61)
    async with GatewayHarness([worker], api_keys=[f"team:{SECRET}"], tenants=tenants) as gw:
        cut = await gw.post(CHAT, chat(stream=True), headers=AUTH)
        assert cut.status == 200 and cut.body.count(b"tok") == 60
        assert cut.body.rstrip().endswith(b"data: [DONE]")  # read to its end
        worker.die_after = None  # the next stream ends with its usage
        after = await gw.post(CHAT, chat(stream=True), headers=AUTH)
        assert after.status == 200
        left = int(after.headers["x-ratelimit-remaining-tokens"])
    lines = [orjson.loads(line) for line in log_path.read_bytes().splitlines()]
    assert [line["request_id"] for line in lines] == [
        cut.headers["x-request-id"],
        after.headers["x-request-id"],
    ]
    estimated, counted = lines
    assert estimated["prompt_tokens"] > 0 and estimated["completion_tokens"] >= 58
    assert estimated["usage_estimated"] is True
    # What the key was charged for the cut stream is what its line says.
    assert 100_000 - left == estimated["prompt_tokens"] + estimated["completion_tokens"]
    assert counted["usage_estimated"] is False
    assert (counted["prompt_tokens"], counted["completion_tokens"]) == (7, 60)
