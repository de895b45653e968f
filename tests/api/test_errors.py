"""FastAPI's side of the error tree (``app.api.errors``): every error response OpenAI-shaped,
FastAPI's and Starlette's own included, and nothing internal leaked."""

from __future__ import annotations

import orjson
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from pydantic import BaseModel

from app import errors
from app.api.errors import error_response, install_handlers


def _shape_ok(body: dict[str, object]) -> dict[str, object]:
    assert set(body) == {"error"}
    err = body["error"]
    assert isinstance(err, dict)
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    return err


def test_an_error_as_a_response_keeps_its_status_body_and_retry_after() -> None:
    for exc in (errors.ModelNotFound("m"), errors.RateLimited("slow", retry_after=3)):
        response = error_response(exc)
        assert response.status_code == exc.status
        assert response.headers["content-type"] == "application/json"
        assert orjson.loads(response.body) == exc.body()
        assert response.headers.get("Retry-After") == exc.headers().get("Retry-After")


class _Body(BaseModel):
    model: str
    n: int = 1


def _app() -> FastAPI:
    app = FastAPI()
    install_handlers(app)

    @app.post("/v1/echo")
    async def echo(body: _Body) -> dict[str, str]:
        return {"model": body.model}

    @app.get("/v1/boom")
    async def boom() -> None:
        raise RuntimeError("secret internal detail")

    @app.get("/v1/unavailable")
    async def unavailable() -> None:
        raise errors.ServiceUnavailable("no healthy worker", retry_after=2)

    return app


@pytest.fixture
def client() -> TestClient:
    return TestClient(_app(), raise_server_exceptions=False)


def test_framework_errors_are_openai_shaped(client: TestClient) -> None:
    cases = [
        (
            client.post(
                "/v1/echo", content=b"{not json", headers={"content-type": "application/json"}
            ),
            400,
        ),
        (client.post("/v1/echo", json={"n": 1}), 400),
        (client.post("/v1/echo", json={"model": "m", "n": "x"}), 400),
        (client.get("/v1/nowhere"), 404),
        (client.get("/v1/echo"), 405),
        (client.get("/v1/unavailable"), 503),
    ]
    for response, status in cases:
        assert response.status_code == status, response.text
        _shape_ok(response.json())
    missing = client.post("/v1/echo", json={"n": 1}).json()["error"]
    assert missing["param"] == "model"
    assert client.get("/v1/unavailable").headers["Retry-After"] == "2"


def test_unexpected_errors_do_not_leak_internals(client: TestClient) -> None:
    response = client.get("/v1/boom")
    assert response.status_code == 500
    err = _shape_ok(response.json())
    assert "secret" not in response.text
    assert err["type"] == "internal_error"
