"""Anthropic's error bodies, its stream's error event and its keep-alive (``event: ping``).

Statuses keep their meaning; the error ``type`` is Anthropic's name for the status: 400
``invalid_request_error`` (and any other 4xx), 401 ``authentication_error``, 403
``permission_error``, 404 ``not_found_error``, 413 ``request_too_large``, 429
``rate_limit_error``, 503 and 529 ``overloaded_error``, 504 ``timeout_error``, any other 5xx
``api_error``.
"""

from __future__ import annotations

from typing import Any

import orjson

from app.errors import GatewayError

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    504: "timeout_error",
    529: "overloaded_error",
}


def error_type(status: int) -> str:
    known = _TYPES.get(status)
    if known is not None:
        return known
    return "invalid_request_error" if 400 <= status < 500 else "api_error"


def error_body(error: GatewayError) -> dict[str, Any]:
    message = error.client_message
    return {"type": "error", "error": {"type": error_type(error.status), "message": message}}


class AnthropicShape:
    keepalive = b'event: ping\ndata: {"type":"ping"}\n\n'

    @staticmethod
    def error_json(error: GatewayError) -> bytes:
        return orjson.dumps(error_body(error))

    @staticmethod
    def error_events(error: GatewayError) -> bytes:
        return b"event: error\ndata: " + orjson.dumps(error_body(error)) + b"\n\n"


ANTHROPIC = AnthropicShape()
