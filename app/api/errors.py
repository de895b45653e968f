"""FastAPI's side of the exception tree: every error response from the app is OpenAI-shaped.

``app.errors`` holds the tree and its two renderings (body, SSE event) with no web framework;
this module turns a ``GatewayError`` into a Starlette ``Response`` and installs the handlers that
do so for the gateway's own errors, FastAPI's validation errors and Starlette's 404/405.
"""

from __future__ import annotations

import logging

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from app.errors import GatewayError, InvalidRequest, error_for_status

log = logging.getLogger(__name__)


def error_response(error: GatewayError) -> Response:
    """``error`` as a JSON response: its status, OpenAI's error body, ``Retry-After`` if any."""
    return Response(
        orjson.dumps(error.body()),
        status_code=error.status,
        headers=error.headers(),
        media_type="application/json",
    )


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
        return error_response(exc)

    async def on_validation_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        message, param = _validation_message(exc)
        return error_response(InvalidRequest(message, param=param))

    async def on_http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        if exc.status_code == 404:
            message = f"no route for {request.method} {request.url.path}"
        elif exc.status_code == 405:
            message = f"method {request.method} is not allowed on {request.url.path}"
        else:
            message = str(exc.detail)
        error = error_for_status(exc.status_code, message)
        response = error_response(error)
        if exc.headers:
            response.headers.update(exc.headers)
        return response

    async def on_unexpected(request: Request, exc: Exception) -> Response:
        # Never leak internals to the client; the traceback goes to the log.
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(GatewayError("internal error"))

    app.add_exception_handler(GatewayError, on_gateway_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    app.add_exception_handler(Exception, on_unexpected)
