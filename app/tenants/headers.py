"""The rate-limit headers on every answer to a key with limits: what its limits allow, in the
names its API's clients read.

OpenAI's API (``openai_headers``): ``x-ratelimit-limit-requests``, ``-remaining-requests``,
``-reset-requests`` for the key's request rate (``limits.key_rate_per_s``, told per minute as
OpenAI does) and ``x-ratelimit-limit-tokens``, ``-remaining-tokens``, ``-reset-tokens`` for its
tokens per minute (``tokens_per_min``). Resets are durations as OpenAI writes them (``1s``,
``6m0s``, ``20ms``). Anthropic's Messages API (``anthropic_headers``): its own names,
``anthropic-ratelimit-requests-limit``, ``-remaining``, ``-reset`` and the same for ``tokens``,
the reset as an RFC 3339 instant. A key without a limit of a kind gets no headers of that kind.

They are rendered once per request, at admission, and sent with the response's head: nothing
per relayed chunk.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from datetime import UTC, datetime

from app.limits.per_key import Budget

Headers = list[tuple[bytes, bytes]]
# Every name, for CORS's expose list (browsers show scripts no other response header).
RATE_LIMIT_HEADERS = tuple(
    f"{prefix}{kind}"
    for kind in ("requests", "tokens")
    for prefix in ("x-ratelimit-limit-", "x-ratelimit-remaining-", "x-ratelimit-reset-")
) + tuple(
    f"anthropic-ratelimit-{kind}-{part}"
    for kind in ("requests", "tokens")
    for part in ("limit", "remaining", "reset")
)


# Renders a request's (requests, tokens) budgets; None: the key has no limit of that kind.
HeaderStyle = Callable[[Budget | None, Budget | None], Headers]


def duration(seconds: float) -> str:
    """A duration as OpenAI's headers write it (Go's ``time.Duration`` format, to the
    millisecond): ``0s``, ``20ms``, ``1.5s``, ``6m0s``, ``1h2m3s``."""
    ms = max(0, math.ceil(seconds * 1000 - 1e-6))
    if ms < 1000:
        return f"{ms}ms" if ms else "0s"
    hours, ms = divmod(ms, 3_600_000)
    minutes, ms = divmod(ms, 60_000)
    secs = f"{ms / 1000:.3f}".rstrip("0").rstrip(".")
    if hours:
        return f"{hours}h{minutes}m{secs}s"
    if minutes:
        return f"{minutes}m{secs}s"
    return f"{secs}s"


def openai_headers(requests: Budget | None, tokens: Budget | None) -> Headers:
    headers: Headers = []
    for kind, budget in ((b"requests", requests), (b"tokens", tokens)):
        if budget is not None:
            headers += (
                (b"x-ratelimit-limit-" + kind, b"%d" % budget.limit),
                (b"x-ratelimit-remaining-" + kind, b"%d" % budget.remaining),
                (b"x-ratelimit-reset-" + kind, duration(budget.reset_s).encode("ascii")),
            )
    return headers


def instant(seconds_from_now: float, now: float) -> bytes:
    """RFC 3339, UTC, to the second (rounded up: never earlier than the limit's reset)."""
    at = datetime.fromtimestamp(math.ceil(now + seconds_from_now), UTC)
    return at.strftime("%Y-%m-%dT%H:%M:%SZ").encode("ascii")


def anthropic_headers(
    requests: Budget | None, tokens: Budget | None, *, clock: Callable[[], float] = time.time
) -> Headers:
    headers: Headers = []
    for kind, budget in ((b"requests", requests), (b"tokens", tokens)):
        if budget is not None:
            prefix = b"anthropic-ratelimit-" + kind
            headers += (
                (prefix + b"-limit", b"%d" % budget.limit),
                (prefix + b"-remaining", b"%d" % budget.remaining),
                (prefix + b"-reset", instant(budget.reset_s, clock())),
            )
    return headers
