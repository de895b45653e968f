"""Which of a client's headers the gateway reads, and which go on to the worker."""

from __future__ import annotations

from collections.abc import Iterable

from app.errors import InvalidRequest

# Never sent to a worker (docs/contracts.md): credentials, Host/Content-Length (set by the client
# library), hop-by-hop headers (RFC 9110 §7.6.1), encodings we would have to undo (a body with a
# Content-Encoding is refused: the gateway reads bodies as they are), the client's
# X-Request-Id (replaced by the gateway's) and Anthropic's API key header (a credential).
_DROP = frozenset(
    {
        b"authorization",
        b"cookie",
        b"host",
        b"content-length",
        b"content-type",
        b"content-encoding",
        b"connection",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"proxy-connection",
        b"te",
        b"trailer",
        b"trailers",
        b"transfer-encoding",
        b"upgrade",
        b"accept-encoding",
        b"expect",
        b"x-request-id",
        b"x-api-key",
    }
)


def client_headers(
    raw: Iterable[tuple[bytes, bytes]], read: frozenset[bytes] = frozenset()
) -> tuple[dict[bytes, bytes], list[tuple[bytes, bytes]]]:
    """One pass over a client's headers (ASGI raw form): the values of those named in ``read``
    (lower-case) and the end-to-end ones that may go to a worker. X-Request-Id is not among
    those: the gateway sends its own (the client's, if sane). A header named in ``read`` given
    more than once is a 400 (``InvalidRequest``): which one counts would be a guess."""
    picked: dict[bytes, bytes] = {}
    forward: list[tuple[bytes, bytes]] = []
    named: set[bytes] = set()  # the headers Connection names are hop-by-hop too
    for name, value in raw:
        name = name.lower()
        if name in read:
            if name in picked:
                raise repeated(name)
            picked[name] = value
        if name in _DROP:
            if name == b"connection":
                named.update(token.strip().lower() for token in value.split(b","))
        else:
            forward.append((name, value))
    if named:
        forward = [(name, value) for name, value in forward if name not in named]
    return picked, forward


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
