"""What a client can see (in process, fake workers on loopback): CORS off unless configured, the
OpenAPI document of the public endpoints, and error bodies that name no worker and carry no stack
trace."""

from __future__ import annotations

from typing import Any

import pytest

from tests.support.gateway import MODEL, FakeWorker, GatewayHarness

CHAT = "/v1/chat/completions"
ORIGIN = "https://app.example.com"


def chat(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **extra}


def _preflight() -> dict[str, str]:
    return {
        "origin": ORIGIN,
        "access-control-request-method": "POST",
        "access-control-request-headers": "authorization,content-type",
    }


async def test_cors_is_off_by_default() -> None:
    async with GatewayHarness([FakeWorker()]) as gw:
        simple = await gw.post(CHAT, chat(), headers={"origin": ORIGIN})
        preflight = await gw.request("OPTIONS", CHAT, headers=_preflight())
    assert simple.status == 200
    assert not any(k.startswith("access-control-") for k in simple.headers)
    assert preflight.status == 405
    assert not any(k.startswith("access-control-") for k in preflight.headers)


async def test_cors_allows_configured_origins_only() -> None:
    async with GatewayHarness([FakeWorker()], cors_origins=[ORIGIN]) as gw:
        preflight = await gw.request("OPTIONS", CHAT, headers=_preflight())
        stream = await gw.post(CHAT, chat(stream=True), headers={"origin": ORIGIN})
        whole = await gw.post(CHAT, chat(), headers={"origin": ORIGIN})
        other = await gw.post(CHAT, chat(), headers={"origin": "https://evil.example"})
    assert preflight.status == 200
    assert preflight.headers["access-control-allow-origin"] == ORIGIN
    assert "authorization" in preflight.headers["access-control-allow-headers"].lower()
    assert stream.headers["access-control-allow-origin"] == ORIGIN
    assert "x-request-id" in stream.headers["access-control-expose-headers"].lower()
    assert stream.body.endswith(b"data: [DONE]\n\n")
    # A whole answer too: its head is written by the server's send, which CORS wraps.
    assert whole.status == 200
    assert whole.headers["access-control-allow-origin"] == ORIGIN
    assert "access-control-allow-origin" not in other.headers


async def test_openapi_documents_the_public_bodies() -> None:
    async with GatewayHarness([FakeWorker()], api_keys=["team:sk-team-0123456789abcdef"]) as gw:
        doc = (await gw.request("GET", "/openapi.json")).json()
    assert set(doc["paths"]) == {
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/models",
        "/v1/models/{model}",
        "/v1/messages",
        "/v1/messages/count_tokens",
        "/v1/responses",
        "/v1/responses/{response_id}",
        "/v1/responses/{response_id}/input_items",
    }
    schemas = doc["components"]["schemas"]
    chat_body = doc["paths"][CHAT]["post"]["requestBody"]["content"]["application/json"]
    assert chat_body["schema"] == {"$ref": "#/components/schemas/ChatCompletionRequest"}
    request = schemas["ChatCompletionRequest"]
    assert request["additionalProperties"] is True  # every other OpenAI/SGLang field passes
    assert {"model", "messages"} <= set(request["required"])
    assert set(request["properties"]["model"]["enum"]) == {MODEL, "kimi-k2.5"}
    assert schemas["CompletionRequest"]["required"] == ["model", "prompt"]
    responses = doc["paths"][CHAT]["post"]["responses"]
    assert {"200", "400", "401", "429", "503"} <= set(responses)
    assert doc["security"] == [{"bearer": []}]


@pytest.mark.parametrize(
    "worker",
    [
        FakeWorker(die_after=2),  # committed, then the connection drops: in-band error
        FakeWorker(fail_status=500),  # the worker's crash
        FakeWorker(hang=True),  # no first byte in time
    ],
    ids=["dies-mid-stream", "worker-500", "first-byte-timeout"],
)
async def test_errors_name_no_worker(worker: FakeWorker) -> None:
    settings: dict[str, Any] = {"timeouts": {"first_byte_s": 0.3}}
    async with GatewayHarness([worker], **settings) as gw:
        ex = await gw.post(CHAT, chat(stream=True))
    assert b'"error"' in ex.body
    assert b"127.0.0.1" not in ex.body
    assert b":%d" % worker.port not in ex.body
    assert b"Traceback" not in ex.body


async def test_unreachable_worker_is_not_named() -> None:
    gone = FakeWorker()
    async with GatewayHarness([gone]) as gw:
        await gone.stop()  # still listed as healthy, but now refuses connections
        ex = await gw.post(CHAT, chat())
    assert ex.status == 502
    error = ex.json()["error"]
    assert error["code"] == "upstream_unavailable"
    assert "127.0.0.1" not in error["message"]
    assert f":{gone.port}" not in error["message"]
