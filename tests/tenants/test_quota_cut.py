"""A stream that ends before its usage chunk (the client hung up, the worker died) still spends
its key's token quota: the tokens the client got are estimated from what was relayed, so cutting
streams short is no way around a quota."""

from __future__ import annotations

import asyncio

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
