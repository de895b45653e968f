"""Which client headers reach a worker, and which the gateway reads (exactly once)."""

from __future__ import annotations

import pytest

from app.errors import InvalidRequest
from app.proxy.headers import client_headers, forwarded, single


def test_encodings_and_credentials_never_reach_a_worker() -> None:
    raw = [
        (b"Content-Encoding", b"identity"),
        (b"Content-Type", b"application/json"),
        (b"Authorization", b"Bearer sk-1"),
        (b"traceparent", b"00-1-2-01"),
    ]
    read, forward = client_headers(raw, frozenset({b"content-encoding", b"authorization"}))
    assert read == {b"content-encoding": b"identity", b"authorization": b"Bearer sk-1"}
    assert forward == [(b"traceparent", b"00-1-2-01")]


def test_headers_reach_a_worker_by_allow_list() -> None:
    raw = [
        (b"X-Override-Priority", b"99"),
        (b"X-Data-Parallel-Rank", b"1"),
        (b"X-Sglext-Return-Input-Ids", b"1"),
        (b"Baggage", b"k=v"),
        (b"X-Emulator-Profile", b"gsm8k"),
    ]
    _, forward = client_headers(raw)
    assert forward == [(b"baggage", b"k=v"), (b"x-emulator-profile", b"gsm8k")]
    _, forward = client_headers(raw, forward=forwarded(["X-Data-Parallel-Rank"]))
    assert forward[0] == (b"x-data-parallel-rank", b"1")


def test_a_header_the_gateway_reads_given_twice_is_a_400() -> None:
    raw = [(b"authorization", b"Bearer a"), (b"Authorization", b"Bearer b")]
    with pytest.raises(InvalidRequest) as info:
        client_headers(raw, frozenset({b"authorization"}))
    assert (info.value.status, info.value.param) == (400, "authorization")
    with pytest.raises(InvalidRequest):
        single(raw, b"authorization")
    assert single(raw[:1], b"authorization") == b"Bearer a"
    # Repeated headers the gateway only passes on stay as they are.
    tags = [(b"x-tag", b"1"), (b"x-tag", b"2")]
    _, forward = client_headers(tags, frozenset(), forwarded(["x-tag"]))
    assert forward == [(b"x-tag", b"1"), (b"x-tag", b"2")]
