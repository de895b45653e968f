"""Request validation, model listing and ops endpoints (in process, fake workers on loopback)."""

from __future__ import annotations

import pytest

from tests.support.gateway import MODEL, FakeWorker, GatewayHarness

CHAT = "/v1/chat/completions"


def _error(ex: object) -> dict[str, object]:
    body = ex.json()  # type: ignore[attr-defined]
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]  # type: ignore[no-any-return]


@pytest.mark.parametrize(
    ("path", "raw", "param"),
    [
        (CHAT, b"{not json", None),
        (CHAT, b"[1, 2]", None),
        (CHAT, b'{"messages": [{"role": "user", "content": "x"}]}', "model"),
        (CHAT, b'{"model": 5, "messages": [{"role": "user", "content": "x"}]}', "model"),
        (CHAT, b'{"model": "m"}', "messages"),
        (CHAT, b'{"model": "m", "messages": "hi"}', "messages"),
        (CHAT, b'{"model": "m", "messages": ["hi"]}', "messages"),
        (CHAT, b'{"model": "m", "messages": [{}], "stream": "yes"}', "stream"),
        (CHAT, b'{"model": "m", "messages": [{}], "max_tokens": "9"}', "max_tokens"),
        (CHAT, b'{"model": "m", "messages": [{}], "stream_options": 1}', "stream_options"),
        ("/v1/completions", b'{"model": "m"}', "prompt"),
    ],
)
async def test_invalid_requests_are_400(path: str, raw: bytes, param: str | None) -> None:
    worker = FakeWorker()
    async with GatewayHarness([worker]) as gw:
        ex = await gw.request("POST", path, raw=raw)
    assert ex.status == 400
    err = _error(ex)
    assert err["type"] == "invalid_request_error"
    assert err["param"] == param
    assert not worker.requests


async def test_unknown_model_is_404_model_not_found() -> None:
    async with GatewayHarness([FakeWorker()]) as gw:
        ex = await gw.post(CHAT, {"model": "gpt-9", "messages": [{"role": "user"}]})
    assert ex.status == 404
    assert _error(ex)["code"] == "model_not_found"


async def test_body_over_the_limit_is_413() -> None:
    async with GatewayHarness([FakeWorker()], limits={"max_body_bytes": 1024}) as gw:
        big = {"model": MODEL, "messages": [{"role": "user", "content": "x" * 2000}]}
        ex = await gw.post(CHAT, big)
    assert ex.status == 413
    assert _error(ex)["code"] == "payload_too_large"


async def test_completions_route_is_proxied() -> None:
    worker = FakeWorker()
    async with GatewayHarness([worker]) as gw:
        ex = await gw.post("/v1/completions", {"model": MODEL, "prompt": "2+2="})
    assert ex.status == 200
    assert worker.requests[0]["prompt"] == "2+2="


async def test_models_lists_pool_models_and_aliases() -> None:
    async with GatewayHarness([FakeWorker()]) as gw:
        ex = await gw.request("GET", "/v1/models")
    data = ex.json()["data"]
    ids = [m["id"] for m in data]
    assert ids == [MODEL, "kimi-k2.5"]
    assert data[0]["max_model_len"] == 262144
    assert data[1]["root"] == MODEL


async def test_retrieve_model_by_name_and_alias() -> None:
    async with GatewayHarness([FakeWorker()]) as gw:
        listed = (await gw.request("GET", "/v1/models")).json()["data"]
        full = await gw.request("GET", f"/v1/models/{MODEL}")
        alias = await gw.request("GET", "/v1/models/kimi-k2.5")
        unknown = await gw.request("GET", "/v1/models/gpt-9")
        schema = (await gw.request("GET", "/openapi.json")).json()
    assert full.status == 200 and alias.status == 200
    assert [full.json(), alias.json()] == listed  # the cards /v1/models lists
    assert alias.json()["root"] == MODEL
    assert unknown.status == 404
    err = _error(unknown)
    assert err["code"] == "model_not_found" and err["param"] == "model"
    assert err["type"] == "invalid_request_error"
    assert "gpt-9" in str(err["message"])
    assert "/v1/models/{model}" in schema["paths"]


async def test_retrieve_model_needs_a_key_like_the_list() -> None:
    secret = "sk-retrieve-0123456789"
    async with GatewayHarness([FakeWorker()], api_keys=[f"team:{secret}"]) as gw:
        missing = await gw.request("GET", f"/v1/models/{MODEL}")
        wrong = await gw.request(
            "GET", "/v1/models/gpt-9", headers={"authorization": "Bearer sk-wrong-0123456789"}
        )
        ok = await gw.request(
            "GET", f"/v1/models/{MODEL}", headers={"authorization": f"Bearer {secret}"}
        )
    assert missing.status == 401 and wrong.status == 401  # auth before existence: no probing
    assert _error(missing)["code"] == "invalid_api_key"
    assert ok.status == 200 and ok.json()["id"] == MODEL


async def test_unknown_v1_route_is_openai_404() -> None:
    async with GatewayHarness([FakeWorker()]) as gw:
        ex = await gw.request("GET", "/v1/embeddings-nope")
    assert ex.status == 404
    _error(ex)


async def test_ops_endpoints() -> None:
    ready_worker, starting_worker = FakeWorker(), FakeWorker(healthy=False)
    async with GatewayHarness([ready_worker, starting_worker]) as gw:
        await gw.post(CHAT, {"model": MODEL, "messages": [{"role": "user", "content": "x"}]})
        live = await gw.request("GET", "/livez")
        ready = await gw.request("GET", "/readyz")
        health = await gw.request("GET", "/health")
        workers = await gw.request("GET", "/workers")
        metrics = await gw.request("GET", "/metrics")
        for worker in gw.gateway.pool.workers:
            worker.state = gw.gateway.pool.workers[1].state
        not_ready = await gw.request("GET", "/readyz")
    assert live.status == 200 and ready.status == 200 and health.status == 200
    assert not_ready.status == 503
    table = {w["name"]: w for w in workers.json()["workers"]}
    assert table[ready_worker.name]["state"] == "healthy"
    assert table[ready_worker.name]["in_flight"] == 0
    assert table[starting_worker.name]["state"] == "starting"
    text = metrics.body.decode()
    assert (
        'dflash_gateway_requests_total{model="moonshotai/Kimi-K2.5",'
        'route="/v1/chat/completions",status="200"} 1.0' in text
    )
    assert "x-request-id" in live.headers
