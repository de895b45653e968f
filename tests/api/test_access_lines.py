"""What the access line says of a request the gateway refused or answered itself: the model and
stream flag a refused body asked for (capped; the formatter escapes it), and a route for every
Responses path."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from app.accesslog import ACCESS_LOGGER
from tests.support.gateway import MODEL, FakeWorker, GatewayHarness

USER = [{"role": "user", "content": "hi"}]


def lines(caplog: pytest.LogCaptureFixture) -> list[dict[str, Any]]:
    return [r.fields for r in caplog.records if r.name == ACCESS_LOGGER]  # type: ignore[attr-defined]


async def test_a_refused_request_names_the_model_and_stream_it_asked_for(
    caplog: pytest.LogCaptureFixture,
) -> None:
    hostile = "evil\u202e\n" + "x" * 500
    bodies = [
        ("/v1/messages", {"model": "claude-opus-5-5", "stream": True, "messages": USER}),
        ("/v1/chat/completions", {"model": MODEL, "stream": True, "messages": "nope"}),
        ("/v1/responses", {"model": hostile, "stream": True, "input": "hi"}),
        ("/v1/chat/completions", {"stream": True, "messages": USER}),
    ]
    with caplog.at_level(logging.INFO, logger=ACCESS_LOGGER):
        async with GatewayHarness([FakeWorker()], model_aliases={"kimi-k2.5": MODEL}) as gw:
            statuses = [(await gw.post(path, body)).status for path, body in bodies]
    assert statuses == [404, 400, 404, 400]
    logged = [(r["route"], r["model"], r["stream"], r["status"]) for r in lines(caplog)]
    assert logged[:2] == [
        ("/v1/messages", "claude-opus-5-5", True, 404),
        ("/v1/chat/completions", MODEL, True, 400),
    ]
    route, model, stream, status = logged[2]
    assert (route, stream, status) == ("/v1/responses", True, 404)
    # Capped here; the log's formatter escapes it (tests/e2e/test_hostile_worker.py).
    assert model.startswith(hostile[:20]) and len(model) <= 200
    assert logged[3] == ("/v1/chat/completions", "-", True, 400)  # no model: none named


async def test_every_responses_path_has_a_route(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger=ACCESS_LOGGER):
        async with GatewayHarness([FakeWorker()]) as gw:
            await gw.request("GET", "/v1/responses/resp_1")
            await gw.request("DELETE", "/v1/responses/resp_1")
            await gw.request("GET", "/v1/responses/resp_1/input_items")
            await gw.request("GET", f"/v1/models/{MODEL}")
            await gw.request("GET", "/v1/responses/a/b/c")
    routed = [(r["route"], r.get("method")) for r in lines(caplog)]
    assert routed == [
        ("/v1/responses/{response_id}", "GET"),
        ("/v1/responses/{response_id}", "DELETE"),
        ("/v1/responses/{response_id}/input_items", "GET"),
        ("/v1/models/{model}", "GET"),
        ("other", "GET"),
    ]
