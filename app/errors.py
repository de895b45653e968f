"""The gateway's one exception tree and its two renderings: an OpenAI error body and an SSE event.

::

    GatewayError                        500 internal_error
    ├── InvalidRequest                  400 invalid_request_error
    │   ├── PayloadTooLarge             413
    │   ├── RequestTimeout              408  the client sent its request too slowly
    │   ├── UnsupportedMediaType        415  not a JSON body (or an encoded one)
    │   └── HeadersTooLarge             431
    ├── AuthenticationFailed            401 authentication_error (invalid_api_key)
    ├── NotFound                        404 (not_found)
    │   └── ModelNotFound               404 (model_not_found)
    ├── MethodNotAllowed                405
    ├── RateLimited                     429 rate_limit_exceeded   + Retry-After
    ├── ServiceUnavailable              503 service_unavailable   + Retry-After
    └── UpstreamError                   502 upstream_error        (a worker failed us)
        ├── UpstreamConnectError        502  connect refused/reset before a response: retryable
        ├── UpstreamTimeout             504  no first byte / idle too long
        ├── UpstreamStatusError         the worker's own status, its message rewrapped
        └── UpstreamStreamBroken        502  the stream ended without [DONE] after the commit point

Lower layers raise these (or have their own errors mapped to these at the boundary); the FastAPI
handlers in ``install_handlers`` turn every error, including FastAPI's own validation errors and
404/405, into ``{"error": {"message", "type", "param", "code"}}``. Mid-stream the same error becomes
``data: {"error": ...}`` followed by ``data: [DONE]``.

Clients read ``client_message``: for errors about workers a generic sentence, because the detailed
``message`` names the worker (often host:port); that goes to the access log only.
"""

from __future__ import annotations

import logging
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

log = logging.getLogger(__name__)

SSE_DONE = b"data: [DONE]\n\n"


class GatewayError(Exception):
    status: int = 500
    type: str = "internal_error"
    code: str | None = None

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        status: int | None = None,
        retry_after: int | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code
        if status is not None:
            self.status = status
        self.retry_after = retry_after

    @property
    def client_message(self) -> str:
        """What the client reads; ``message`` (the log's version) may say more."""
        return self.message

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.client_message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def headers(self) -> dict[str, str]:
        if self.retry_after is None:
            return {}
        return {"Retry-After": str(self.retry_after)}

    def to_response(self) -> Response:
        return Response(
            orjson.dumps(self.body()),
            status_code=self.status,
            headers=self.headers(),
            media_type="application/json",
        )

    def to_sse(self) -> bytes:
        """The error as one SSE event; the caller follows it with ``SSE_DONE``."""
        return b"data: " + orjson.dumps(self.body()) + b"\n\n"


class InvalidRequest(GatewayError):
    status = 400
    type = "invalid_request_error"


class PayloadTooLarge(InvalidRequest):
    status = 413
    code = "payload_too_large"


class RequestTimeout(InvalidRequest):
    status = 408
    code = "request_timeout"


class UnsupportedMediaType(InvalidRequest):
    status = 415
    code = "unsupported_media_type"


class HeadersTooLarge(InvalidRequest):
    status = 431
    code = "request_header_fields_too_large"


class AuthenticationFailed(GatewayError):
    status = 401
    type = "authentication_error"
    code = "invalid_api_key"


class NotFound(GatewayError):
    status = 404
    type = "invalid_request_error"
    code = "not_found"


class ModelNotFound(NotFound):
    code = "model_not_found"


class MethodNotAllowed(GatewayError):
    status = 405
    type = "invalid_request_error"
    code = "method_not_allowed"


class RateLimited(GatewayError):
    status = 429
    type = "rate_limit_exceeded"
    code = "rate_limit_exceeded"


class ServiceUnavailable(GatewayError):
    status = 503
    type = "service_unavailable"
    code = "service_unavailable"


class UpstreamError(GatewayError):
    status = 502
    type = "upstream_error"
    code = "upstream_error"
    # Whether another worker may be tried (only ever before the commit point).
    retryable = False
    # The client's version of ``message``, which names the worker.
    public = "a worker failed while serving the request"

    @property
    def client_message(self) -> str:
        return self.public


class UpstreamConnectError(UpstreamError):
    code = "upstream_unavailable"
    retryable = True
    public = "no worker could be reached for the request"


class UpstreamTimeout(UpstreamError):
    status = 504
    type = "timeout"
    code = "upstream_timeout"
    public = "the worker did not answer in time"


class UpstreamStatusError(UpstreamError):
    """A worker answered with an error status; status and message are the worker's."""

    RETRYABLE_STATUSES = frozenset({502, 503, 504})

    def __init__(self, message: str, *, status: int, param: str | None = None) -> None:
        super().__init__(message, status=status, param=param, code=str(status))
        self.type = "invalid_request_error" if 400 <= status < 500 else "upstream_error"
        self.retryable = status in self.RETRYABLE_STATUSES

    @property
    def client_message(self) -> str:
        # The worker's own words for a refused request (4xx, a full queue); not for its crashes.
        if status_passes_message(self.status):
            return self.message
        return f"the worker failed to process the request (HTTP {self.status})"

    @classmethod
    def from_worker(cls, status: int, raw: bytes) -> UpstreamStatusError:
        """Rewrap SGLang's ``{"object": "error", "message": ...}`` (or an OpenAI body)."""
        message = f"worker returned HTTP {status}"
        param = None
        try:
            data = orjson.loads(raw) if raw else None
        except orjson.JSONDecodeError:
            data = None
        if isinstance(data, dict):
            nested = data.get("error")
            inner: dict[str, Any] = nested if isinstance(nested, dict) else data
            if isinstance(inner.get("message"), str) and inner["message"]:
                message = inner["message"]
            if isinstance(inner.get("param"), str):
                param = inner["param"]
        return cls(message, status=status, param=param)


class UpstreamStreamBroken(UpstreamError):
    code = "stream_interrupted"
    public = "the worker's stream was interrupted"


def status_passes_message(status: int) -> bool:
    return status < 500 or status == 503


_STATUS_ERRORS: dict[int, type[GatewayError]] = {
    400: InvalidRequest,
    401: AuthenticationFailed,
    404: NotFound,
    405: MethodNotAllowed,
    413: PayloadTooLarge,
    429: RateLimited,
    503: ServiceUnavailable,
}


def error_for_status(status: int, message: str) -> GatewayError:
    cls = _STATUS_ERRORS.get(status, GatewayError)
    return cls(message, status=status)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = ".".join(loc) or None
    msg = str(first.get("msg", "invalid value"))
    if first.get("type") == "json_invalid":
        return "request body is not valid JSON", None
    return (f"{param}: {msg}" if param else msg), param


def install_handlers(app: FastAPI) -> None:
    """Make every error response from ``app`` OpenAI-shaped."""

    async def on_gateway_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, GatewayError)
        return exc.to_response()

    async def on_validation_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        message, param = _validation_message(exc)
        return InvalidRequest(message, param=param).to_response()

    async def on_http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        if exc.status_code == 404:
            message = f"no route for {request.method} {request.url.path}"
        elif exc.status_code == 405:
            message = f"method {request.method} is not allowed on {request.url.path}"
        else:
            message = str(exc.detail)
        error = error_for_status(exc.status_code, message)
        response = error.to_response()
        if exc.headers:
            response.headers.update(exc.headers)
        return response

    async def on_unexpected(request: Request, exc: Exception) -> Response:
        # Never leak internals to the client; the traceback goes to the log.
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return GatewayError("internal error").to_response()

    app.add_exception_handler(GatewayError, on_gateway_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    app.add_exception_handler(Exception, on_unexpected)
