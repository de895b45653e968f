"""The Messages routes in the gateway, on real sockets against scripted workers: what reaches
the worker, every error in Anthropic's shape, aborts, and the relay's direct lane."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson

from tests.support.gateway import MODEL, FakeWorker, GatewayHarness

KEY = "sk-team-0123456789abcdef"
KEYS = {"api_keys": [f"team:{KEY}"]}
AUTH = {"x-api-key": KEY, "anthropic-version": "2023-06-01"}
BODY: dict[str, Any] = {
    "model": MODEL,
    "max_tokens": 64,
    "messages": [{"role": "user", "content": "Hi"}],
}


def anthropic_error(body: bytes) -> tuple[str, str]:
    doc = orjson.loads(body)
    assert doc["type"] == "error" and set(doc["error"]) == {"type", "message"}
    return doc["error"]["type"], doc["error"]["message"]


async def test_the_worker_gets_a_chat_request_without_the_client_credentials() -> None:
    worker = FakeWorker()
    async with GatewayHarness([worker], **KEYS) as gw:
        body = {
            **BODY,
            "stream": True,
            "metadata": {"user_id": "session-7"},
            "system": [{"type": "text", "text": "S", "cache_control": {"type": "ephemeral"}}],
            "thinking": {"type": "disabled"},
            "stop_sequences": ["\n\nHuman:"],
            "container": "dropped",
        }
        ex = await gw.post("/v1/messages", body, headers={**AUTH, "anthropic-beta": "b"})
        ops = {"authorization": f"Bearer {KEY}"}  # keys are configured: /metrics needs one
        metrics = (await gw.request("GET", "/metrics", headers=ops)).body.decode()
    assert ex.status == 200 and ex.body.endswith(b'data: {"type":"message_stop"}\n\n')
    sent = worker.requests[0]
    assert len(sent.pop("rid")) == 32
    assert sent == {
        "model": MODEL,
        "messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"}],
        "max_tokens": 64,
        "stop": ["\n\nHuman:"],
        "user": "session-7",
        "chat_template_kwargs": {"thinking": False},
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    assert "x-api-key" not in worker.headers[0] and "authorization" not in worker.headers[0]
    dropped = "dflash_gateway_requests_with_dropped_fields_total"
    assert f'{dropped}{{route="/v1/messages"}} 1.0' in metrics
    requests = 'dflash_gateway_requests_total{model="moonshotai/Kimi-K2.5",route="/v1/messages"'
    assert f'{requests},status="200"}} 1.0' in metrics


async def test_streams_take_the_direct_lane() -> None:
    worker = FakeWorker(texts=tuple("abcdefgh"))
    async with GatewayHarness([worker]) as gw:
        ex = await gw.post("/v1/messages", {**BODY, "stream": True})
    assert ex.status == 200
    assert gw.lane_writes > 0  # translated in the worker connection's read callback
    assert ex.body.count(b"event: content_block_delta") == 8


async def test_non_streamed_answer_is_a_message() -> None:
    async with GatewayHarness([FakeWorker(meta_info={"spec_verify_ct": 2})]) as gw:
        ex = await gw.post("/v1/messages", BODY)
    doc = ex.json()
    assert ex.status == 200 and ex.headers["content-type"] == "application/json"
    assert doc["content"] == [{"type": "text", "text": "Hello!"}]
    assert doc["usage"] == {"input_tokens": 7, "output_tokens": 3}
    assert doc["model"] == MODEL and doc["type"] == "message"


async def test_errors_before_the_proxy_are_anthropic_shaped() -> None:
    async with GatewayHarness([FakeWorker()], limits={"max_body_bytes": 2048}, **KEYS) as gw:
        missing = await gw.post("/v1/messages", BODY)
        wrong = await gw.post("/v1/messages", BODY, headers={"x-api-key": "sk-wrong-0000000000"})
        bearer = await gw.post("/v1/messages", BODY, headers={"authorization": f"Bearer {KEY}"})
        bad_bearer = {"authorization": "Bearer sk-wrong-0000000000"}
        wrong_bearer = await gw.post("/v1/messages", BODY, headers=bad_bearer)
        typed = await gw.request(
            "POST", "/v1/messages", raw=b"hi", headers={**AUTH, "content-type": "text/plain"}
        )
        big = {**BODY, "messages": [{"role": "user", "content": "x" * 4000}]}
        too_big = await gw.post("/v1/messages", big, headers=AUTH)
        unknown = await gw.post("/v1/messages", {**BODY, "model": "nope"}, headers=AUTH)
        count = await gw.post("/v1/messages/count_tokens", {"model": MODEL}, headers=AUTH)
        models = await gw.request("GET", "/v1/models", headers=AUTH)
    # In Anthropic's words: Claude Code shows the message as it is.
    assert (missing.status, anthropic_error(missing.body)) == (
        401,
        ("authentication_error", "x-api-key header is required"),
    )
    assert (wrong.status, anthropic_error(wrong.body)) == (
        401,
        ("authentication_error", "invalid x-api-key"),
    )
    assert bearer.status == 200
    # A wrong key sent as a bearer token is named as one; no SDK retries a wrong key.
    assert wrong_bearer.status == 401 and wrong_bearer.headers["x-should-retry"] == "false"
    kind, text = anthropic_error(wrong_bearer.body)
    assert kind == "authentication_error" and text.startswith("invalid bearer token: ")
    assert "x-api-key" in text and "ANTHROPIC_AUTH_TOKEN" in text
    assert (typed.status, anthropic_error(typed.body)[0]) == (415, "invalid_request_error")
    assert (too_big.status, anthropic_error(too_big.body)[0]) == (413, "request_too_large")
    assert (unknown.status, anthropic_error(unknown.body)[0]) == (404, "not_found_error")
    assert count.status == 400
    assert models.status == 200 and models.json()["data"][0]["id"] == MODEL
    assert anthropic_error(count.body) == (
        "invalid_request_error",
        "messages: a non-empty array is required",
    )


async def test_no_worker_is_overloaded_with_retry_after() -> None:
    async with GatewayHarness([FakeWorker(fail_status=503), FakeWorker(fail_status=503)]) as gw:
        ex = await gw.post("/v1/messages", {**BODY, "stream": True})
    assert ex.status == 503 and "retry-after" in ex.headers
    assert anthropic_error(ex.body) == ("overloaded_error", "The request queue is full.")


async def test_a_worker_refusal_keeps_its_status_and_message() -> None:
    async with GatewayHarness([FakeWorker(fail_status=400)]) as gw:
        ex = await gw.post("/v1/messages", BODY)
    assert ex.status == 400
    assert anthropic_error(ex.body) == ("invalid_request_error", "The request queue is full.")


async def test_client_leaving_aborts_the_worker() -> None:
    worker = FakeWorker(hold_after=2)
    gone = asyncio.Event()
    async with GatewayHarness([worker]) as gw:

        def on_chunk(chunk: bytes) -> None:
            if b"message_start" in chunk:
                gone.set()

        ex = await gw.post(
            "/v1/messages", {**BODY, "stream": True}, disconnect=gone, on_chunk=on_chunk
        )
        await asyncio.wait_for(worker.closed.wait(), 5)
        rid = worker.requests[0]["rid"]
        for _ in range(200):
            if rid in worker.aborted:
                break
            await asyncio.sleep(0.01)
    assert not ex.complete
    assert rid in worker.aborted


async def test_count_tokens_goes_to_a_worker() -> None:
    worker = FakeWorker()
    async with GatewayHarness([worker]) as gw:
        ex = await gw.post(
            "/v1/messages/count_tokens",
            {**BODY, "tools": [{"name": "t", "input_schema": {"type": "object"}}]},
        )
    # The scripted worker answers like a chat completion, without input_tokens: refused.
    assert ex.status == 502 and anthropic_error(ex.body)[0] == "api_error"
    sent = worker.requests[0]
    assert set(sent) == {"model", "messages", "tools", "rid"}  # max_tokens is not forwarded


async def test_a_body_sent_too_slowly_is_408_in_anthropic_shape() -> None:
    async with GatewayHarness([FakeWorker()], timeouts={"client_body_s": 0.3}) as gw:
        host, port = gw.url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(  # headers, then part of the body, then nothing
            b"POST /v1/messages?beta=true HTTP/1.1\r\nHost: x\r\n"
            b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{"
        )
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(), 10)
        writer.close()
    head, body = answer.split(b"\r\n\r\n", 1)
    assert head.startswith(b"HTTP/1.1 408")
    assert anthropic_error(body)[0] == "invalid_request_error"


async def test_user_id_keeps_a_session_on_its_worker_and_max_tokens_is_capped() -> None:
    workers = [FakeWorker(), FakeWorker(), FakeWorker()]
    settings: dict[str, Any] = {"policy": "prefix_affinity", "limits": {"max_tokens_cap": 8}}
    async with GatewayHarness(workers, **settings) as gw:
        for session in ("alpha", "beta"):
            for turn in range(3):
                body = {
                    **BODY,
                    "max_tokens": 32000,
                    "metadata": {"user_id": session},
                    "messages": [{"role": "user", "content": f"turn {turn}"}],
                }
                assert (await gw.post("/v1/messages", body)).status == 200
    for worker in workers:
        assert all(sent["max_tokens"] == 8 for sent in worker.requests)
    served = {
        session: {i for i, w in enumerate(workers) for r in w.requests if r["user"] == session}
        for session in ("alpha", "beta")
    }
    assert all(len(where) == 1 for where in served.values())  # each session on one worker
