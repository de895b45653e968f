"""Requests refused before any worker was asked: answered in their surface's shape, with one
access-log line and a count in ``requests_total`` each.

The proxy records the requests it runs (``app.proxy.forward``), ``app.api.access`` what FastAPI
answers; this module records the rest:

- ``refuse``: a request of the surface registry's routes that a check of the door refused
  (400/401/404/413/415/429/503), answered in its surface's shape (OpenAI's or Anthropic's);
- ``reject``: the record of such a refusal alone;
- ``refusals(gw)``: requests the server's protocol answered itself (408, 431, 400 for unparsable
  HTTP, 503 over ``limits.max_connections``; ``app.server.guard``).

``requests_total{route}`` counts the API: the surface registry's POST routes (``app.surfaces``,
passed in as ``routes``), ``/v1/models`` and refusals at the protocol layer (route ``other`` when
the path is not one of those, e.g. a 431 whose request line never ended). Probes, scrapes and
unknown paths are in the access log only, so the metric's label set stays bounded and its error
ratio is about API traffic. The access line's ``route`` is one of a fixed set of paths, else
``other``; an ``other`` line also names the request's ``method`` and ``path`` (``client_text``:
control characters, quotes, backslashes and spaces escaped, at most 200 characters) so an operator
sees which endpoint a client wanted.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Sequence

import orjson

from app.accesslog import AccessRecord
from app.errors import GatewayError
from app.gateway import Gateway
from app.metrics import OTHER
from app.outcomes import Outcome
from app.proxy.downstream import Send, send_error
from app.proxy.request import ParsedRequest
from app.proxy.surface import ErrorShape

MODELS_ROUTE = "/v1/models"
OPS_ROUTES = frozenset(
    {"/", "/api/hello", "/livez", "/readyz", "/health", "/metrics", "/workers", "/openapi.json"}
)
NO_MODEL = "-"
REJECTED = Outcome.REJECTED
MAX_CLIENT_TEXT = 200
# Bytes a log line shows escaped: C0 controls, space, quote, backslash, DEL, and every non-ASCII
# byte (a path is bytes on the wire; as UTF-8 it may hold C1 controls or bidi overrides).
_ESCAPED = {b: f"\\x{b:02x}" for b in (*range(0x21), 0x22, 0x5C, *range(0x7F, 0x100))}


def _capped(text: str) -> str:
    return text if len(text) <= MAX_CLIENT_TEXT else text[: MAX_CLIENT_TEXT - 3] + "..."


def client_text(raw: bytes) -> str:
    """A client-chosen string (a method, a path) safe to write in a log line: printable ASCII,
    anything else escaped as ``\\xNN``, at most ``MAX_CLIENT_TEXT`` characters (``...`` marks
    the cut)."""
    return _capped("".join(_ESCAPED.get(b, chr(b)) for b in raw[: MAX_CLIENT_TEXT + 1]))


# Where a refused body's model and stream flag are looked for (the log names what was asked).
_ASKED_WINDOW = 4096
_MODEL = re.compile(rb'"model"\s*:\s*"((?:[^"\\]|\\.){1,%d})' % (MAX_CLIENT_TEXT + 1))
_STREAM = re.compile(rb'"stream"\s*:\s*true\b')


def asked_for(parsed: ParsedRequest | None, raw: bytes) -> tuple[str, bool]:
    """The model and stream flag a refused request asked for: the parsed request's, else what
    the body's first bytes say (JSON escapes decoded), capped at ``MAX_CLIENT_TEXT``
    characters, else ``-``/false. The log's formatters escape it (``app.accesslog``: a control
    character never breaks a line; JSON lines by their encoder), as they do the served model."""
    if parsed is not None:
        return _capped(parsed.model), parsed.stream
    head = raw[:_ASKED_WINDOW]
    found = _MODEL.search(head)
    name = NO_MODEL
    if found is not None:
        value = found.group(1)
        try:
            name = orjson.loads(b'"' + value + b'"')
        except orjson.JSONDecodeError:  # cut inside an escape, or not JSON at all: as sent
            name = value.decode("utf-8", "backslashreplace")
        name = _capped(name)
    return name, _STREAM.search(head) is not None


def reject(
    gw: Gateway,
    route: str,
    request_id: str,
    error: GatewayError,
    *,
    key: str | None = None,
    duration_s: float | None = None,
    path: str | None = None,
    asked: tuple[str, bool] = (NO_MODEL, False),
    client_request_id: str | None = None,
) -> None:
    """Record a request answered with ``error`` before any worker was asked. The metric names
    no model (it may be any string a client sent); the access line names ``asked`` (the model
    and stream flag the request asked for, escaped: ``asked_for``). ``path``: the target's path
    (escaped) when ``route`` is ``other``."""
    gw.metrics.record_request(route, OTHER, error.status)
    record = AccessRecord(
        request_id, route, asked[0], asked[1], key=key, status=error.status, outcome=REJECTED
    )
    record.client_request_id = client_request_id
    record.path = path
    record.error = error.message
    if duration_s is not None:
        record.duration_ms = round(duration_s * 1000, 3)
    gw.access.emit(record)


def refusals(gw: Gateway, routes: Collection[str]) -> Callable[[bytes, str, GatewayError], None]:
    """The server protocol's ``Report`` (``app.server.guard``) for this gateway, whose API POST
    routes are ``routes``."""
    api = frozenset(route.encode("ascii") for route in (*routes, MODELS_ROUTE))

    def report(target: bytes, request_id: str, error: GatewayError) -> None:
        path = target.split(b"?", 1)[0]
        if path in api:
            reject(gw, path.decode("latin-1"), request_id, error)
        else:
            reject(gw, OTHER, request_id, error, path=client_text(path) or None)

    return report


async def refuse(
    gw: Gateway,
    send: Send,
    route: str,
    request_id: str,
    error: GatewayError,
    shape: ErrorShape,
    headers: Sequence[tuple[bytes, bytes]],
    *,
    key: str | None,
    duration_s: float,
    asked: tuple[str, bool] = (NO_MODEL, False),
    client_request_id: str | None = None,
    echo_id: str | None = None,
) -> None:
    """Record ``error`` (``reject``) under ``request_id`` and answer it in ``shape``, with
    ``headers`` (the key's rate-limit headers, once they are known) and ``echo_id`` (default:
    ``request_id``) as its X-Request-Id."""
    reject(
        gw,
        route,
        request_id,
        error,
        key=key,
        duration_s=duration_s,
        asked=asked,
        client_request_id=client_request_id,
    )
    await send_error(send, error, (echo_id or request_id).encode("ascii"), shape, headers)
