"""How ``/openapi.json`` declares the Messages routes: any JSON object as the body (the translator,
``request.py``, is the one that checks it), a Message or its events as the answer, and every error
in Anthropic's shape (``shape.py``) with the status's ``type``."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel

from app.door.entry import Operation


class AnthropicErrorDetail(BaseModel):
    type: str
    message: str


class AnthropicError(BaseModel):
    type: Literal["error"]
    error: AnthropicErrorDetail


_BODY = {
    "requestBody": {
        "required": True,
        "content": {"application/json": {"schema": {"type": "object"}}},
    }
}
_ANSWER: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "a Message, or its events when stream is true (Anthropic's shapes)",
        "content": {
            "application/json": {"schema": {"type": "object"}},
            "text/event-stream": {"schema": {}},
        },
    }
}
_WHY = {
    400: "invalid request (invalid_request_error)",
    401: "missing, wrong or revoked API key (authentication_error)",
    404: "unknown model (not_found_error)",
    408: "the request was sent too slowly",
    413: "body too large (request_too_large)",
    415: "the body is not JSON (Content-Type must be application/json) or is encoded",
    429: "per-key rate or concurrency limit (rate_limit_error; see Retry-After)",
    500: "internal error (api_error)",
    502: "a worker failed (api_error)",
    503: "no worker can take the request now (overloaded_error; see Retry-After)",
    504: "a worker did not answer in time (timeout_error)",
}
_ANSWER.update(
    {status: {"model": AnthropicError, "description": why} for status, why in _WHY.items()}
)


def operation(name: str) -> Operation:
    return Operation(name, _BODY, _ANSWER)
