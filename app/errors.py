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
        ├── UpstreamBadResponse         502  not an HTTP/1.1 answer the gateway accepts: retryable
        │   └── UpstreamForeignAnswer   502  the answer to another request (its id is not ours)
        ├── UpstreamStatusError         the worker's own status, its message rewrapped
        └── UpstreamStreamBroken        502  the stream ended without [DONE] after the commit point

Lower layers raise these (or have their own errors mapped to these at the boundary). This module
imports no web framework: the FastAPI handlers (``app.api.errors.install_handlers``) turn every
error, including FastAPI's own validation errors and 404/405, into
``{"error": {"message", "type", "param", "code"}}``. Mid-stream the same error becomes
``data: {"error": ...}`` followed by ``data: [DONE]``.

Clients read ``client_message``: for errors about workers a generic sentence, because the detailed
``message`` names the worker (often host:port); that goes to the access log only.
"""

from __future__ import annotations

from typing import Any

import orjson

from app.outcomes import Outcome

SSE_DONE = b"data: [DONE]\n\n"


class GatewayError(Exception):
    status: int = 500
    type: str = "internal_error"
    code: str | None = None
    # How a request that ends with this error is recorded (access log, stream_outcomes_total).
    outcome: Outcome = Outcome.UPSTREAM_ERROR

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

    def headers(self) -> dict[str, str]:
        # The OpenAI and Anthropic SDKs read it: the same key will not be let in on a retry.
        return {"x-should-retry": "false"}


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
    # What the key's request rate had left when it was refused (``app.limits.Budget``,
    # for its rate-limit headers); None when the key has no request rate limit.
    budget: Any = None


class ServiceUnavailable(GatewayError):
    status = 503
    outcome = Outcome.NO_CAPACITY
    type = "service_unavailable"
    code = "service_unavailable"


class UpstreamError(GatewayError):
    status = 502
    type = "upstream_error"
    code: str | None = "upstream_error"
    # Whether another worker may be tried (only ever before the commit point).
    retryable = False
    # The client's version of ``message``, which names the worker.
    public = "a worker failed while serving the request"
    # How the upstream attempt that raised it is recorded (upstream_attempts_total).
    attempt_outcome: Outcome = Outcome.BROKEN

    @property
    def client_message(self) -> str:
        return self.public

    @property
    def reason(self) -> str:
        """A bounded, server-controlled name of the failure (metric label, log field)."""
        return self.code or "error"


class UpstreamConnectError(UpstreamError):
    code = "upstream_unavailable"
    attempt_outcome = Outcome.CONNECT_ERROR
    retryable = True
    public = "no worker could be reached for the request"


class UpstreamBadResponse(UpstreamError):
    """The worker's answer broke HTTP/1.1 or the API: unparsable, a protocol switch, a head too
    large, bytes after its end, a redirect, or a non-streamed body that is not JSON."""

    code = "bad_upstream_response"
    retryable = True
    public = "a worker sent an invalid response"


class UpstreamForeignAnswer(UpstreamBadResponse):
    """The worker's answer (a whole one, or a stream's first event) carries the id of another
    request than the attempt's ``rid``: a late stray response on a reused connection, or a worker
    out of step. Its connection is closed; retryable like any bad response."""


class UpstreamTimeout(UpstreamError):
    status = 504
    type = "timeout"
    outcome = Outcome.UPSTREAM_TIMEOUT
    attempt_outcome = Outcome.TIMEOUT
    code = "upstream_timeout"
    public = "the worker did not answer in time"


# OpenAI's error types for a refused request; anything else from a worker becomes
# ``invalid_request_error`` (4xx) or ``server_error`` (5xx).
_CLIENT_ERROR_TYPES = frozenset(
    {
        "invalid_request_error",
        "authentication_error",
        "permission_error",
        "not_found_error",
        "rate_limit_error",
    }
)
_STATUS_CODES = {429: "rate_limit_exceeded", 503: "service_unavailable"}
_MAX_CODE = 64
_MAX_PARAM = 256


class UpstreamStatusError(UpstreamError):
    """A worker answered with an error status; status and message are the worker's, type and
    code are OpenAI's (see ``from_worker``)."""

    RETRYABLE_STATUSES = frozenset({502, 503, 504})
    attempt_outcome = Outcome.STATUS_ERROR

    def __init__(
        self,
        message: str,
        *,
        status: int,
        param: str | None = None,
        code: str | None = None,
        type_: str | None = None,
    ) -> None:
        super().__init__(message, status=status, param=param)
        client_error = 400 <= status < 500
        self.code = code
        self.type = type_ or ("invalid_request_error" if client_error else "server_error")
        self.retryable = status in self.RETRYABLE_STATUSES

    @property
    def client_message(self) -> str:
        # The worker's own words for a refused request (4xx, a full queue); not for its crashes.
        if status_passes_message(self.status):
            return self.message
        return f"the worker failed to process the request (HTTP {self.status})"

    @property
    def reason(self) -> str:
        return str(self.status)

    @classmethod
    def from_worker(cls, status: int, raw: bytes) -> UpstreamStatusError:
        """Rewrap SGLang's ``{"object": "error", "message", "type", "param", "code": 400}`` (or
        an OpenAI body) in OpenAI's shape: the worker's message and ``param``; ``type`` OpenAI's
        (the worker's when it is one of OpenAI's client-error types on a 4xx); ``code`` the
        worker's when it is a string name (not a number), else ``context_length_exceeded`` for
        a prompt too long, else one implied by the status (429, 503), else null."""
        message = f"worker returned HTTP {status}"
        param = code = type_ = None
        try:
            data = orjson.loads(raw) if raw else None
        except orjson.JSONDecodeError:
            data = None
        if isinstance(data, dict):
            nested = data.get("error")
            inner: dict[str, Any] = nested if isinstance(nested, dict) else data
            if isinstance(inner.get("message"), str) and inner["message"]:
                message = inner["message"]
            if isinstance(inner.get("param"), str) and len(inner["param"]) <= _MAX_PARAM:
                param = inner["param"]
            code = _code_name(inner.get("code"))
            if 400 <= status < 500 and inner.get("type") in _CLIENT_ERROR_TYPES:
                type_ = inner["type"]
        if code is None and 400 <= status < 500 and "context length" in message.lower():
            code = "context_length_exceeded"  # SGLang's and OpenAI's words for a long prompt
        if code is None:
            code = _STATUS_CODES.get(status)
        return cls(message, status=status, param=param, code=code, type_=type_)


def _code_name(code: object) -> str | None:
    """``code`` if it is a name like ``context_length_exceeded`` (SGLang sends the status)."""
    if not isinstance(code, str) or not 0 < len(code) <= _MAX_CODE or not code.isascii():
        return None
    bare = code.replace("_", "").replace("-", "").replace(".", "")
    return code if bare.isalnum() and not bare.isdigit() else None


class UpstreamStreamBroken(UpstreamError):
    code = "stream_interrupted"
    outcome = Outcome.STREAM_BROKEN
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
