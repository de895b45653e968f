"""Who may call the gateway: the caller's API key NAME (``app.auth``), checked once per request
before its body is read -- never per stream chunk.

``key_name`` gives the caller's key name (None when no keys are configured) or raises a 401 in
OpenAI shape (the door answers it in the surface's). ``ops_key_of``: ``/metrics`` and
``/workers`` need a key when keys are configured unless ``auth.protect_ops`` is false (the
separate metrics port only when it is true: it is Prometheus's); probes never need one.
"""

from __future__ import annotations

from collections.abc import Callable

from app.auth.keystore import bearer_token
from app.errors import AuthenticationFailed
from app.gateway import Gateway
from app.proxy.headers import single

# What a client is told when its key is missing or wrong, in its API's words.
OPENAI_KEY_TEXTS = (
    "You didn't provide an API key. You need to provide your API key in an Authorization "
    "header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY).",
    "Incorrect API key provided.",
)
ANTHROPIC_KEY_TEXTS = ("x-api-key header is required", "invalid x-api-key")
# Anthropic's clients also send a key as a bearer token (Claude Code's ANTHROPIC_AUTH_TOKEN): a
# wrong one is named as what it is, not as the x-api-key header the client never sent.
ANTHROPIC_BEARER_WRONG = (
    "invalid bearer token: the Authorization header's key is not one of this gateway's keys "
    "(Claude Code sends ANTHROPIC_AUTH_TOKEN there, ANTHROPIC_API_KEY as x-api-key)"
)
# The texts a request's key is refused with, given the headers it sent (``Entry.key_texts``).
KeyTexts = Callable[[dict[bytes, bytes]], tuple[str, str]]


def openai_key_texts(read: dict[bytes, bytes]) -> tuple[str, str]:
    return OPENAI_KEY_TEXTS


def anthropic_key_texts(read: dict[bytes, bytes]) -> tuple[str, str]:
    """``x-api-key``'s texts, unless the key came only as ``Authorization: Bearer``."""
    if b"x-api-key" not in read and b"authorization" in read:
        return ANTHROPIC_KEY_TEXTS[0], ANTHROPIC_BEARER_WRONG
    return ANTHROPIC_KEY_TEXTS


def key_name(
    authorization: str | None, gw: Gateway, texts: tuple[str, str] = OPENAI_KEY_TEXTS
) -> str | None:
    """The caller's key name (from its Authorization header); None when the gateway is open.
    Raises ``AuthenticationFailed`` with ``texts``' (missing, wrong) message."""
    keys = gw.keys
    if keys.open:
        return None
    token = bearer_token(authorization)
    if token is None:
        raise AuthenticationFailed(texts[0])
    name = keys.authenticate(token)
    if name is None:
        raise AuthenticationFailed(texts[1])
    return name


def authorization(headers: list[tuple[bytes, bytes]]) -> str | None:
    """The request's Authorization header (ASGI raw headers); more than one is a 400."""
    value = single(headers, b"authorization")
    return value.decode("latin-1") if value is not None else None


def ops_key_of(
    gw: Gateway, headers: list[tuple[bytes, bytes]], *, metrics_port: bool = False
) -> None:
    """``/metrics`` and ``/workers`` need a key when keys are configured (401/400), unless
    ``auth.protect_ops`` is false; on the metrics port only when it is true."""
    protect = gw.settings.auth.protect_ops
    if protect if protect is not None else not metrics_port:
        key_name(authorization(headers), gw)
