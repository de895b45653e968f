"""The surface registry (``app.surfaces``): every API route it lists is dispatched, declared in
``/openapi.json``, counted under its own ``route`` label from start-up, and answers errors in its
surface's shape -- with nothing about a route written anywhere else."""

from __future__ import annotations

import orjson

from app.errors import UnsupportedMediaType
from app.proxy.surface import CHAT, COMPLETIONS, OPENAI
from app.surfaces import BY_PATH, ROUTES, SURFACES, shape_of
from tests.support.gateway import MODEL, FakeWorker, GatewayHarness


def test_the_table_lists_every_api_and_chat_is_a_peer_surface() -> None:
    assert ROUTES == (
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/messages",
        "/v1/messages/count_tokens",
        "/v1/responses",
    )
    assert BY_PATH["/v1/chat/completions"].surface is CHAT
    assert BY_PATH["/v1/completions"].surface is COMPLETIONS


def test_refusal_shape_follows_the_target() -> None:
    anthropic = BY_PATH["/v1/messages"].shape
    assert anthropic is not OPENAI
    assert shape_of(b"/v1/messages?beta=true") is anthropic
    assert shape_of(b"/v1/messages/count_tokens") is anthropic
    assert shape_of(b"/v1/chat/completions") is OPENAI
    assert shape_of(b"/nowhere") is OPENAI


async def test_every_route_is_served_declared_and_counted() -> None:
    plain = {"content-type": "text/plain"}
    async with GatewayHarness([FakeWorker()]) as gw:
        doc = (await gw.request("GET", "/openapi.json")).json()
        metrics = (await gw.request("GET", "/metrics")).body.decode()
        answers = {
            entry.route: await gw.request("POST", entry.route, raw=b"x", headers=plain)
            for entry in SURFACES
        }
    for entry in SURFACES:
        assert doc["paths"][entry.route]["post"]["operationId"].startswith(entry.operation.name)
        assert f'route="{entry.route}"' in metrics
        ex = answers[entry.route]
        assert ex.status == 415  # the door ran, not FastAPI's 404
        expected = orjson.loads(entry.shape.error_json(UnsupportedMediaType("x")))
        assert set(ex.json()) == set(expected)


async def test_an_unknown_model_is_told_what_would_work_on_every_surface() -> None:
    """Every surface's 404 names the served model and the aliases (patterns too); Messages adds
    Claude Code's variable, Responses Codex's setting; Responses checks the model before its
    input, as chat and Messages do (an input it would refuse still gets the 404)."""
    aliases = {"model_aliases": {"kimi-k2.5": MODEL, "claude-*": MODEL}}
    user = [{"role": "user", "content": "hi"}]
    bodies = {
        "/v1/chat/completions": {"model": "gpt-x", "messages": user},
        "/v1/completions": {"model": "gpt-x", "prompt": "hi"},
        "/v1/messages": {"model": "gpt-x", "max_tokens": 8, "messages": user},
        "/v1/messages/count_tokens": {"model": "gpt-x", "messages": user},
        "/v1/responses": {"model": "gpt-x", "input": [{"type": "additional_tools", "tools": []}]},
    }
    async with GatewayHarness([FakeWorker()], **aliases) as gw:
        answers = {path: await gw.post(path, body) for path, body in bodies.items()}
        card = await gw.request("GET", "/v1/models/gpt-x")
        by_pattern = await gw.request("GET", "/v1/models/claude-opus-5-5")
    listed = f"Use one of: {MODEL}, kimi-k2.5, claude-* (GET /v1/models)."
    for path, answer in [*answers.items(), ("/v1/models/gpt-x", card)]:
        doc = answer.json()
        assert answer.status == 404, (path, doc)
        message = doc["error"]["message"]
        assert message.startswith("The model `gpt-x` does not exist.") and listed in message
        assert ("ANTHROPIC_MODEL" in message) == path.startswith("/v1/messages"), message
        assert ("config.toml" in message) == (path == "/v1/responses"), message
    assert by_pattern.status == 200 and by_pattern.json()["root"] == MODEL
