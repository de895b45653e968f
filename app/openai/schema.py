"""The OpenAI surface's bodies and errors as ``/openapi.json`` declares them.

The door reads request bodies itself (``app.proxy.request``), so these models only DOCUMENT the
bodies; FastAPI never validates with them. They describe what the gateway itself
checks, and allow other fields (``additionalProperties``): those on the allow-list of
``app.proxy.fields`` reach the workers, denied ones are a 400, the rest are dropped.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

Role = Literal["system", "developer", "user", "assistant", "tool", "function"]


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class StreamOptions(_Open):
    include_usage: bool | None = None


class ChatMessage(_Open):
    role: Role = "user"
    content: str | list[Any] | None = None


class _Generation(_Open):
    model: str = Field(min_length=1, description="a served model or one of its aliases")
    max_tokens: int | None = Field(
        None, ge=1, description="larger values are lowered to the gateway's cap"
    )
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None


class ChatCompletionRequest(_Generation):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)


class CompletionRequest(_Generation):
    prompt: str | list[str] | list[int] | list[list[int]] = Field(
        min_length=1, description="text, texts, token ids or arrays of token ids"
    )


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | int | None


class ErrorResponse(BaseModel):
    error: ErrorDetail


_ERRORS: dict[int | str, str] = {
    400: "invalid request (the worker's own 4xx errors keep their status)",
    401: "missing, wrong or revoked API key",
    404: "unknown model",
    408: "the request was sent too slowly",
    413: "body too large",
    415: "the body is not JSON (Content-Type must be application/json) or is encoded",
    429: "per-key rate or concurrency limit (see Retry-After)",
    500: "internal error",
    502: "a worker failed",
    503: "no worker can take the request now (see Retry-After)",
    504: "a worker did not answer in time",
}


def error_responses() -> dict[int | str, dict[str, Any]]:
    return {status: {"model": ErrorResponse, "description": why} for status, why in _ERRORS.items()}


def request_body(model: type[BaseModel]) -> dict[str, Any]:
    """``openapi_extra`` for a route whose body ``model`` documents."""
    ref = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}


def completion_responses() -> dict[int | str, dict[str, Any]]:
    ok = {
        "description": "the worker's answer: JSON, or server-sent events when stream is true",
        "content": {
            "application/json": {"schema": {"type": "object"}},
            "text/event-stream": {"schema": {}},
        },
    }
    return {200: ok, **error_responses()}
