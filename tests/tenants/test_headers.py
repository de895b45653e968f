from __future__ import annotations

import pytest

from app.limits.per_key import Budget
from app.tenants.headers import anthropic_headers, duration, openai_headers


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0, "0s"),
        (0.0004, "1ms"),
        (0.02, "20ms"),
        (1, "1s"),
        (1.5, "1.5s"),
        (8.64, "8.64s"),
        (59.9996, "1m0s"),
        (360, "6m0s"),
        (3723.25, "1h2m3.25s"),
        (-3, "0s"),
    ],
)
def test_durations_read_as_openai_writes_them(seconds: float, text: str) -> None:
    assert duration(seconds) == text


def test_openai_headers_for_each_kind_of_limit_the_key_has() -> None:
    requests, tokens = Budget(60, 59, 1.0), Budget(40000, 39000, 90)
    assert dict(openai_headers(requests, tokens)) == {
        b"x-ratelimit-limit-requests": b"60",
        b"x-ratelimit-remaining-requests": b"59",
        b"x-ratelimit-reset-requests": b"1s",
        b"x-ratelimit-limit-tokens": b"40000",
        b"x-ratelimit-remaining-tokens": b"39000",
        b"x-ratelimit-reset-tokens": b"1m30s",
    }
    assert [name for name, _ in openai_headers(None, tokens)] == [
        b"x-ratelimit-limit-tokens",
        b"x-ratelimit-remaining-tokens",
        b"x-ratelimit-reset-tokens",
    ]
    assert openai_headers(None, None) == []


def test_anthropic_headers_give_the_reset_as_an_instant() -> None:
    def clock() -> float:
        return 1_767_225_599.2  # 2025-12-31T23:59:59.2Z

    headers = dict(anthropic_headers(Budget(60, 0, 1.5), None, clock=clock))
    assert headers == {
        b"anthropic-ratelimit-requests-limit": b"60",
        b"anthropic-ratelimit-requests-remaining": b"0",
        b"anthropic-ratelimit-requests-reset": b"2026-01-01T00:00:01Z",
    }
