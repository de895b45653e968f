"""Which of a client's headers the gateway reads, and which go on to the worker.

Headers reach a worker by allow-list. An SGLang worker acts on request headers that the body's
field allow-list (``app.proxy.fields``) cannot see: ``X-Data-Parallel-Rank`` always picks the dp
rank; with ``SGLANG_ENABLE_REQUEST_HEADER_OVERRIDES=1`` the ``X-Override-*`` family sets the
request's priority (past the tenant's class), its rid (a collision makes the gateway's abort
miss), the disaggregation bootstrap host/port/room and the routed dp rank; ``X-SMG-Routing-Key``
and ``X-Sglext-Return-*-Ids`` change routing and the answer's shape; a metrics-labels header
named by the worker's configuration labels its metrics. New SGLang releases add more, so a
deny-list would always trail them. What a worker gets from the client:

- ``traceparent``, ``tracestate`` (W3C Trace Context) and ``baggage`` (W3C Baggage): the worker's
  spans join the client's trace. With the gateway's own tracing on, it replaces the first two with
  its attempt span's (``app.tracing.otel``).
- ``x-emulator-profile``: the emulated worker's acceptance profile (the emulator's contract; an
  SGLang worker ignores it).

and from the gateway itself: ``X-Request-Id`` (the client's if sane, else minted), ``Content-Type:
application/json``, ``Accept-Encoding: identity`` and the workers' own key (``app.upstream``).
Nothing else: credentials, cookies, hop-by-hop headers, ``X-Session-Id`` and the priority header
are the gateway's business, not the worker's. ``limits.forward_headers`` names more to pass on
(e.g. ``x-smg-routing-key`` where an operator wants it); a header the Connection header names is
hop-by-hop and never forwarded, allowed or not.
"""

from __future__ import annotations

from collections.abc import Iterable

from app.errors import InvalidRequest

FORWARDED = frozenset({b"traceparent", b"tracestate", b"baggage", b"x-emulator-profile"})


def forwarded(extra: Iterable[str] = ()) -> frozenset[bytes]:
    """The names (lower-case bytes) of the client headers a worker gets: the built-in ones plus
    ``extra`` (``limits.forward_headers``; the settings refuse credentials, framing and
    hop-by-hop headers there)."""
    return FORWARDED | {name.strip().lower().encode("latin-1") for name in extra}


def client_headers(
    raw: Iterable[tuple[bytes, bytes]],
    read: frozenset[bytes] = frozenset(),
    forward: frozenset[bytes] = FORWARDED,
) -> tuple[dict[bytes, bytes], list[tuple[bytes, bytes]]]:
    """One pass over a client's headers (ASGI raw form): the values of those named in ``read``
    (lower-case) and those named in ``forward`` that go on to a worker, unless the Connection
    header names them. A header named in ``read`` given more than once is a 400
    (``InvalidRequest``): which one counts would be a guess."""
    picked: dict[bytes, bytes] = {}
    passed: list[tuple[bytes, bytes]] = []
    named: set[bytes] = set()  # the headers Connection names are hop-by-hop
    for name, value in raw:
        name = name.lower()
        if name in read:
            if name in picked:
                raise repeated(name)
            picked[name] = value
        if name in forward:
            passed.append((name, value))
        elif name == b"connection":
            named.update(token.strip().lower() for token in value.split(b","))
    if named and passed:
        passed = [(name, value) for name, value in passed if name not in named]
    return picked, passed


def repeated(name: bytes) -> InvalidRequest:
    header = name.decode("latin-1")
    return InvalidRequest(f"the {header} header was given more than once", param=header)


def single(raw: Iterable[tuple[bytes, bytes]], wanted: bytes) -> bytes | None:
    """The value of header ``wanted`` (lower-case), None if absent; a 400 (``InvalidRequest``)
    if it was given more than once."""
    found: bytes | None = None
    for name, value in raw:
        if name.lower() == wanted:
            if found is not None:
                raise repeated(wanted)
            found = value
    return found
