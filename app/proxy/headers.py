"""Which of a client's headers the gateway reads, and which go on to the worker."""

from __future__ import annotations

from collections.abc import Iterable

# Never forwarded to a worker (CONTRACTS.md): credentials, Host/Content-Length (set by the client
# library), hop-by-hop headers (RFC 9110 §7.6.1), encodings we would have to undo, and the
# client's X-Request-Id (replaced by the gateway's).
_DROP = frozenset(
    {
        b"authorization",
        b"cookie",
        b"host",
        b"content-length",
        b"content-type",
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
    }
)


def client_headers(
    raw: Iterable[tuple[bytes, bytes]], read: frozenset[bytes] = frozenset()
) -> tuple[dict[bytes, bytes], list[tuple[bytes, bytes]]]:
    """One pass over a client's headers (ASGI raw form): the values of those named in ``read``
    (lower-case; the last of repeated ones wins) and the end-to-end ones that may go to a worker.
    X-Request-Id is not among those: the gateway sends its own (the client's, if sane)."""
    picked: dict[bytes, bytes] = {}
    forward: list[tuple[bytes, bytes]] = []
    named: set[bytes] = set()  # the headers Connection names are hop-by-hop too
    for name, value in raw:
        name = name.lower()
        if name in read:
            picked[name] = value
        if name in _DROP:
            if name == b"connection":
                named.update(token.strip().lower() for token in value.split(b","))
        else:
            forward.append((name, value))
    if named:
        forward = [(name, value) for name, value in forward if name not in named]
    return picked, forward
