"""The proxy against scripted workers on loopback, served as `dflash-gateway serve` serves it."""

from __future__ import annotations

import asyncio
import re

import orjson
import pytest

from app.config import Settings
from app.errors import SSE_DONE
from tests.support.gateway import MODEL, FakeWorker, GatewayHarness, chat_chunks, wait_for

CHAT = "/v1/chat/completions"


def chat(**extra: object) -> dict[str, object]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **extra}


def events(body: bytes) -> list[bytes]:
    return [e + b"\n\n" for e in body.split(b"\n\n") if e]


async def test_stream_relays_the_workers_bytes_and_drops_the_forced_usage_chunk() -> None:
    worker = FakeWorker()
    async with GatewayHarness([worker]) as gw:
        ex = await gw.post(CHAT, chat(stream=True))
    sent = worker.requests[0]
    assert sent["stream_options"] == {"include_usage": True}  # forced
    expected = chat_chunks(sent["rid"], worker.texts)
    assert ex.status == 200
    assert ex.body == b"".join(c for c in expected if b'"choices":[]' not in c)
    assert ex.complete
    assert ex.headers["content-type"] == "text/event-stream"
    assert ex.headers["cache-control"] == "no-cache"
    assert ex.headers["x-accel-buffering"] == "no"
    assert re.fullmatch(r"[0-9a-f]{32}", ex.headers["x-request-id"])


async def test_stream_with_include_usage_is_byte_identical() -> None:
    worker = FakeWorker()
    async with GatewayHarness([worker]) as gw:
        ex = await gw.post(CHAT, chat(stream=True, stream_options={"include_usage": True}))
    assert ex.body == b"".join(chat_chunks(worker.requests[0]["rid"], worker.texts))


async def test_non_stream_body_is_the_workers() -> None:
    worker = FakeWorker()
    async with GatewayHarness([worker]) as gw:
        ex = await gw.post(CHAT, chat())
    assert ex.status == 200
    assert ex.json()["id"] == worker.requests[0]["rid"]
    assert ex.json()["choices"][0]["message"]["content"] == "Hello!"
    assert ex.headers["content-type"] == "application/json"


async def test_body_forwarded_with_fresh_rid_and_unknown_fields_dropped() -> None:
    worker = FakeWorker()
    async with GatewayHarness([worker]) as gw:
        await gw.post(CHAT, chat(foo={"bar": [1, 2]}, top_k=5))
        await gw.post(CHAT, chat(foo=1))
        own_rid = await gw.post(CHAT, chat(rid="client-rid"))  # the gateway's to choose
    first, second = worker.requests
    assert own_rid.status == 400 and own_rid.json()["error"]["param"] == "rid"
    assert re.fullmatch(r"[0-9a-f]{32}", first["rid"])
    assert first["rid"] != second["rid"]
    assert "foo" not in first and first["top_k"] == 5
    assert first["messages"] == [{"role": "user", "content": "hi"}]


async def test_headers_to_workers() -> None:
    worker = FakeWorker()
    async with GatewayHarness([worker], worker_api_key="worker-secret") as gw:
        ex = await gw.post(
            CHAT,
            chat(),
            headers={
                "Authorization": "Bearer client-key",
                "Cookie": "a=b",
                "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
                "X-Request-Id": "req-123",
                "X-Emulator-Profile": "gsm8k",
                "Connection": "keep-alive, X-Hop",
                "X-Hop": "1",
            },
        )
    sent = worker.headers[0]
    assert sent["authorization"] == "Bearer worker-secret"
    assert "cookie" not in sent and "x-hop" not in sent
    assert sent["traceparent"].startswith("00-0af7")
    # The client's own id, echoed and sent on (the records' id is the gateway's own).
    assert sent["x-request-id"] == "req-123"
    assert sent["x-emulator-profile"] == "gsm8k"
    assert ex.headers["x-request-id"] == "req-123"


# What SGLang 0.5.23 acts on (X-Data-Parallel-Rank always, the X-Override-* family with
# SGLANG_ENABLE_REQUEST_HEADER_OVERRIDES=1) and other headers only the gateway reads.
SGLANG_OVERRIDES = {
    "X-Override-Priority": "1000000",
    "X-Override-Rid": "victim-rid",
    "X-Override-Bootstrap-Host": "10.0.0.9",
    "X-Override-Bootstrap-Port": "8998",
    "X-Override-Bootstrap-Room": "7",
    "X-Override-Routed-Dp-Rank": "3",
    "X-Override-Conversation-Id": "c",
    "X-Data-Parallel-Rank": "1",
    "X-SMG-Routing-Key": "k",
    "X-Sglext-Return-Input-Ids": "1",
    "X-Sglext-Return-Output-Ids": "1",
    "X-Session-Id": "s1",
    "X-Priority": "high",
    "User-Agent": "curl/8",
    "Forwarded": "for=10.0.0.1",
}


async def test_only_allowed_client_headers_reach_a_worker() -> None:
    worker = FakeWorker()
    client = {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}
    client |= {"tracestate": "v=1", "baggage": "a=b", "X-Emulator-Profile": "mbpp"}
    async with GatewayHarness([worker]) as gw:
        ex = await gw.post(CHAT, chat(), headers={**SGLANG_OVERRIDES, **client})
        assert ex.status == 200
        stream = await gw.post(CHAT, chat(stream=True), headers=SGLANG_OVERRIDES)
        assert stream.status == 200
    gateway_set = {"host", "content-length", "content-type", "accept-encoding", "x-request-id"}
    assert set(worker.headers[0]) - gateway_set == {k.lower() for k in client}
    assert set(worker.headers[1]) - gateway_set == set()
    assert worker.requests[0]["rid"] != "victim-rid"


async def test_forward_headers_setting_passes_named_headers_on() -> None:
    worker = FakeWorker()
    limits = {"forward_headers": ("X-SMG-Routing-Key",)}
    async with GatewayHarness([worker], limits=limits) as gw:
        await gw.post(CHAT, chat(), headers=SGLANG_OVERRIDES)
    assert worker.headers[0]["x-smg-routing-key"] == "k"
    assert "x-override-priority" not in worker.headers[0]


@pytest.mark.parametrize("name", ["Authorization", "cookie", "x-request-id", "te", "a b", ""])
def test_forward_headers_refuses_credentials_framing_and_non_names(name: str) -> None:
    with pytest.raises(ValueError, match=r"never forwarded|not a header name"):
        Settings(limits={"forward_headers": (name,)})


async def test_no_client_authorization_without_a_worker_key() -> None:
    worker = FakeWorker()
    async with GatewayHarness([worker]) as gw:
        await gw.post(CHAT, chat(), headers={"Authorization": "Bearer client-key"})
    assert "authorization" not in worker.headers[0]


async def test_max_tokens_default_and_clamp() -> None:
    worker = FakeWorker()
    limits = {"default_max_tokens": 100, "max_tokens_cap": 1000}
    async with GatewayHarness([worker], limits=limits) as gw:
        await gw.post(CHAT, chat())
        await gw.post(CHAT, chat(max_tokens=5000))
        await gw.post(CHAT, chat(max_completion_tokens=50))
    assert worker.requests[0]["max_tokens"] == 100
    assert worker.requests[1]["max_tokens"] == 1000
    assert worker.requests[2]["max_completion_tokens"] == 50
    assert "max_tokens" not in worker.requests[2]


async def test_alias_is_resolved_for_the_worker() -> None:
    worker = FakeWorker()
    async with GatewayHarness([worker]) as gw:
        ex = await gw.post(CHAT, chat(model="kimi-k2.5"))
    assert ex.status == 200
    assert worker.requests[0]["model"] == MODEL


async def test_no_buffering_chunk_k_arrives_while_the_worker_holds() -> None:
    worker = FakeWorker(hold_after=2)
    got: list[bytes] = []
    async with GatewayHarness([worker]) as gw:
        task = asyncio.create_task(gw.post(CHAT, chat(stream=True), on_chunk=got.append))
        await asyncio.wait_for(worker.held.wait(), 5)
        sent = chat_chunks(worker.requests[0]["rid"], worker.texts)[:2]
        await wait_for(lambda: b"".join(got) == b"".join(sent))
        assert not task.done()
        worker.release.set()
        ex = await task
    assert ex.body.endswith(SSE_DONE)


async def test_keepalive_during_silence_then_the_stream_continues() -> None:
    worker = FakeWorker(hold_after=0)
    got: list[bytes] = []
    async with GatewayHarness([worker], timeouts={"keepalive_s": 0.05}) as gw:
        task = asyncio.create_task(gw.post(CHAT, chat(stream=True), on_chunk=got.append))
        await wait_for(lambda: b": keep-alive\n\n" in b"".join(got))
        worker.release.set()
        ex = await task
    assert ex.status == 200
    assert ex.body.startswith(b": keep-alive\n\n")
    data = [e for e in events(ex.body) if e != b": keep-alive\n\n"]
    assert data == [*chat_chunks(worker.requests[0]["rid"], worker.texts)[:-2], SSE_DONE]


async def test_client_disconnect_aborts_on_the_same_worker() -> None:
    worker = FakeWorker(hold_after=2)
    gone = asyncio.Event()
    async with GatewayHarness([worker]) as gw:
        task = asyncio.create_task(gw.post(CHAT, chat(stream=True), disconnect=gone))
        await asyncio.wait_for(worker.held.wait(), 5)
        gone.set()  # the client closes its connection mid-stream (committed: the direct lane)
        ex = await asyncio.wait_for(task, 5)
        await wait_for(lambda: worker.aborted)
        assert worker.aborted == [worker.requests[0]["rid"]]
        await asyncio.wait_for(worker.closed.wait(), 5)  # the worker connection was dropped too
        await wait_for(lambda: gw.gateway.pool.workers[0].in_flight == 0)
    assert ex.status == 200 and not ex.complete


async def test_worker_dying_mid_stream_gives_error_event_then_done() -> None:
    workers = [FakeWorker(die_after=3), FakeWorker(die_after=3)]
    # Continuations off (app.proxy.continuation; tests/e2e/test_continuation.py has them on).
    async with GatewayHarness(workers, retry={"mid_stream_attempts": 0}) as gw:
        ex = await gw.post(CHAT, chat(stream=True))
    assert ex.status == 200
    evs = events(ex.body)
    assert evs[-1] == SSE_DONE
    err = orjson.loads(evs[-2][len(b"data: ") :])
    assert err["error"]["code"] == "stream_interrupted"
    (worker,) = [w for w in workers if w.requests]  # committed: never retried on the other
    assert len(worker.requests) == 1
    assert evs[:-2] == chat_chunks(worker.requests[0]["rid"], worker.texts)[:3]


async def test_a_whole_answer_cut_after_the_worker_began_is_retried_from_scratch() -> None:
    # Nothing reached the client yet: the request is retried on another worker, as it is.
    bad, good = FakeWorker(die_after=0), FakeWorker()
    async with GatewayHarness([bad, good], policy="round_robin") as gw:
        results = [await gw.post(CHAT, chat()) for _ in range(2)]
    for ex in results:
        assert ex.status == 200
        assert orjson.loads(ex.body)["choices"][0]["message"]["content"] == "Hello!"
    assert bad.requests and len(good.requests) == 2
    assert bad.requests[0]["messages"] == good.requests[0]["messages"]


@pytest.mark.parametrize(
    "failure", [{"fail_status": 503}, {"die_after": 0}, {"leading_error": 503}]
)
async def test_failure_before_commit_is_retried_on_another_worker(
    failure: dict[str, int],
) -> None:
    bad = FakeWorker(**failure)  # type: ignore[arg-type]
    good = FakeWorker()
    async with GatewayHarness([bad, good], policy="round_robin") as gw:
        results = [await gw.post(CHAT, chat(stream=True)) for _ in range(2)]
    for ex in results:
        assert ex.status == 200
        assert ex.body.endswith(SSE_DONE)
        assert b'"error"' not in ex.body
    assert bad.requests and len(good.requests) == 2
    assert bad.requests[0]["rid"] not in {r["rid"] for r in good.requests}
    if "die_after" in failure:
        await wait_for(lambda: bad.aborted)


async def test_all_workers_failing_returns_their_status_with_retry_after() -> None:
    async with GatewayHarness([FakeWorker(fail_status=503)]) as gw:
        ex = await gw.post(CHAT, chat(stream=True))
    assert ex.status == 503
    assert ex.headers["retry-after"]
    assert ex.json()["error"]["message"] == "The request queue is full."


async def test_worker_4xx_is_rewrapped_and_not_retried() -> None:
    bad, good = FakeWorker(fail_status=400), FakeWorker()
    async with GatewayHarness([bad, good], policy="round_robin") as gw:
        ex = await gw.post(CHAT, chat())
    assert ex.status == 400
    assert set(ex.json()["error"]) == {"message", "type", "param", "code"}
    assert not good.requests


async def test_upstream_timeout_is_504_and_aborted() -> None:
    worker = FakeWorker(hang=True)
    async with GatewayHarness([worker], timeouts={"first_byte_s": 0.1}) as gw:
        ex = await gw.post(CHAT, chat(stream=True))
        await wait_for(lambda: worker.aborted)
        assert gw.gateway.pool.workers[0].in_flight == 0
    assert ex.status == 504
    assert ex.json()["error"]["code"] == "upstream_timeout"


async def test_idle_timeout_after_commit_is_an_error_event() -> None:
    worker = FakeWorker(hold_after=2)
    async with GatewayHarness([worker], timeouts={"idle_s": 0.1}) as gw:
        ex = await gw.post(CHAT, chat(stream=True))
        await wait_for(lambda: worker.aborted)
    assert ex.status == 200
    evs = events(ex.body)
    assert evs[-1] == SSE_DONE
    assert orjson.loads(evs[-2][6:])["error"]["code"] == "upstream_timeout"


async def test_no_healthy_worker_is_503_with_retry_after() -> None:
    async with GatewayHarness([FakeWorker(), FakeWorker(healthy=False)]) as gw:
        gw.gateway.pool.workers[0].state = gw.gateway.pool.workers[1].state
        ex = await gw.post(CHAT, chat())
    assert ex.status == 503
    assert ex.headers["retry-after"] == "2"


async def test_total_time_limit_ends_a_long_stream_with_an_error_event() -> None:
    worker = FakeWorker(hold_after=2)
    async with GatewayHarness([worker], timeouts={"total_s": 0.2}) as gw:
        ex = await gw.post(CHAT, chat(stream=True))
        await wait_for(lambda: worker.aborted)
        assert gw.gateway.pool.workers[0].in_flight == 0
    evs = events(ex.body)
    assert evs[-1] == SSE_DONE
    assert orjson.loads(evs[-2][6:])["error"]["code"] == "upstream_timeout"


def test_every_connection_header_names_hop_by_hop_headers() -> None:
    from app.proxy.headers import client_headers

    raw = [
        (b"Connection", b"keep-alive, X-Hop"),
        (b"connection", b"X-Other"),
        (b"X-Hop", b"1"),
        (b"x-other", b"2"),
        (b"X-Session-Id", b"s1"),
        (b"traceparent", b"00-1-2-01"),
    ]
    forward_set = frozenset({b"x-hop", b"x-other", b"traceparent"})
    read, forward = client_headers(raw, frozenset({b"x-session-id"}), forward_set)
    assert read == {b"x-session-id": b"s1"}
    assert forward == [(b"traceparent", b"00-1-2-01")]


async def test_committed_stream_leaves_through_the_direct_lane_byte_identical() -> None:
    """Past the commit point the relay writes the worker's bytes straight to the client's
    connection (the server's direct lane); the client still gets exactly the worker's stream."""
    worker = FakeWorker(texts=tuple(f"piece {i} " for i in range(40)))
    async with GatewayHarness([worker]) as gw:
        ex = await gw.post(CHAT, chat(stream=True, stream_options={"include_usage": True}))
    assert ex.complete
    assert ex.body == b"".join(chat_chunks(worker.requests[0]["rid"], worker.texts))
    assert gw.lanes_offered == 1
    assert gw.lane_writes >= 1


async def test_slow_reader_pauses_the_worker_and_gets_every_byte() -> None:
    """A client that stops reading stops the gateway reading the worker: the worker cannot get
    its stream out (TCP pushes back all the way) while the gateway holds no more than a write
    buffer's worth for that client; reading on delivers every byte, in order."""
    total = 32 * 1024 * 1024  # four times what the socket buffers on the way hold on loopback
    piece = "x" * (32 * 1024)
    worker = FakeWorker(texts=(piece,) * (total // len(piece)))
    async with GatewayHarness([worker]) as gw:
        assert gw.client is not None and gw.server is not None
        body = orjson.dumps(chat(stream=True, stream_options={"include_usage": True}))
        response = await gw.client.open("POST", CHAT, body, {"content-type": "application/json"})
        got = bytearray()
        while b"\n\n" not in got:
            part = await response.read()
            assert part is not None
            got += part
        # The client reads no more.
        await wait_for(lambda: worker.stalled.is_set() or worker.finished.is_set(), timeout=30)
        assert not worker.finished.is_set(), (
            "the gateway read the whole stream for a stalled client"
        )
        buffered = [c.transport.get_write_buffer_size() for c in gw.server.server_state.connections]
        assert max(buffered) <= 512 * 1024
        while (part := await response.read()) is not None:
            got += part
        gw.client.done(response)
        assert worker.finished.is_set()
    assert bytes(got) == b"".join(chat_chunks(worker.requests[0]["rid"], worker.texts))
