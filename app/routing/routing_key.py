"""The routing key of ``prefix_affinity`` (docs/contracts.md): ``X-Session-Id``, else the request's
``user`` field, else a hash of the leading conversation (system prompt + first user turn), so every
turn of one conversation shares a key and lands where SGLang's radix cache holds its prefix.

The conversation is hashed from the raw JSON spans the request parser kept (each message's role and
content as the client wrote them; for text completions the first 2 KiB of the prompt), never from a
re-serialised copy."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any, Protocol

SESSION_HEADER = "x-session-id"
_MAX_KEY_CHARS = 256


class Routable(Protocol):
    @property
    def user(self) -> str | None: ...

    @property
    def conversation(self) -> Sequence[Any]: ...  # bytes-like parts


def routing_key(request: Routable, session: str | None = None) -> str | None:
    if session:
        return "s:" + session[:_MAX_KEY_CHARS]
    user = request.user
    if user:
        return "u:" + user[:_MAX_KEY_CHARS]
    parts = request.conversation
    if not parts:
        return None
    # NUL separates the parts: it never occurs in a role nor, unescaped, in JSON text.
    return "c:" + hashlib.blake2b(b"\0".join(parts), digest_size=16).hexdigest()
