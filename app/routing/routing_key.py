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
_HASHED_BYTES = 65536


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
    # Each part's length, then at most its first 64 KiB: an agent's first turn can be a
    # megabyte of repository context, and its length with its head tells conversations apart
    # for a tenth of the hashing.
    digest = hashlib.blake2b(digest_size=16)
    for part in parts:
        view = memoryview(part)  # bytes or msgspec.Raw: no copy
        digest.update(len(view).to_bytes(8, "little"))
        digest.update(view[:_HASHED_BYTES])
    return "c:" + digest.hexdigest()
