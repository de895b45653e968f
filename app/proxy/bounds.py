"""The numeric bounds on a request the gateway enforces before a worker sees it: how many tokens
(a default when the client set none, a cap when it asked for more) and how many choices."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec

from app.errors import InvalidRequest
from app.limits.config import LimitsConfig

_INT = msgspec.json.Decoder(int)


def patch_max_tokens(
    body: Any, names: Sequence[str], limits: LimitsConfig, patch: dict[str, bytes]
) -> int | None:
    """Check the token-count fields ``names`` of ``body`` (decoded ints or unset) and note in
    ``patch`` the values the worker must get instead: the cap, or the default when none is set.
    Returns the most tokens a choice may then have (None: no bound, up to the context length)."""
    bound: int | None = None
    for name in names:
        value = getattr(body, name)
        if value is None or value is msgspec.UNSET:
            continue
        if value < 1:
            raise InvalidRequest(f"{name}: must be a positive integer", param=name)
        if value >= 2**63:
            raise InvalidRequest(f"{name}: must be a positive integer below 2^63", param=name)
        if value > limits.max_tokens_cap:
            value = limits.max_tokens_cap
            patch[name] = b"%d" % value
        bound = value if bound is None else max(bound, value)
    if bound is None and limits.default_max_tokens is not None:
        bound = min(limits.default_max_tokens, limits.max_tokens_cap)
        patch["max_tokens"] = b"%d" % bound
    return bound


def choices(body: Any, names: Sequence[str], max_n: int) -> int:
    """``n`` (1 when absent or null). Each of ``names`` (``n``, and ``best_of`` on text
    completions; raw JSON spans) must be a JSON integer from 1 to ``max_n``: anything else is
    refused here, since the worker's validation would read ``100.0`` or ``"100"`` as 100 and so
    get past the bound."""
    count = 1
    for name in names:
        value = getattr(body, name)
        if not value or bytes(value) == b"null":
            continue
        try:
            number = _INT.decode(value)
        except msgspec.ValidationError:
            raise InvalidRequest(
                f"{name}: must be an integer from 1 to {max_n}", param=name
            ) from None
        if number < 1:
            raise InvalidRequest(f"{name}: must be an integer from 1 to {max_n}", param=name)
        if number > max_n:
            raise InvalidRequest(f"{name}: at most {max_n} choices per request", param=name)
        if name == "n":
            count = number
    return count
