from __future__ import annotations

import orjson
import pytest

from app.config import LimitsConfig
from app.errors import InvalidRequest
from app.proxy.request import Route, parse_request

ALIASES = {"kimi-k2.5": "moonshotai/Kimi-K2.5"}
RID = "0123456789abcdef0123456789abcdef"


def parse(raw: bytes, route: Route = Route.CHAT, **limits: int) -> object:
    return parse_request(raw, route, limits=LimitsConfig(**limits), aliases=ALIASES)


def test_original_bytes_are_kept_and_rid_appended() -> None:
    raw = b'{"model": "m",  "messages": [{"role": "user", "content": "hi"}], "x": 1.50}\n'
    req = parse(raw)
    body = req.upstream_body(RID)  # type: ignore[attr-defined]
    assert body.startswith(raw.rstrip()[:-1])  # untouched client bytes (even "1.50")
    # Non-streamed chat: the gateway asks for meta_info (the exact acceptance length).
    assert orjson.loads(body) == {**orjson.loads(raw), "return_meta_info": True, "rid": RID}


def test_stream_forces_usage_and_remembers_the_client_did_not_ask() -> None:
    req = parse(b'{"model":"m","messages":[{}],"stream":true}')
    body = orjson.loads(req.upstream_body(RID))  # type: ignore[attr-defined]
    assert body["stream_options"] == {"include_usage": True}
    assert req.client_wants_usage is False  # type: ignore[attr-defined]


def test_client_rid_and_alias_force_one_reserialisation() -> None:
    req = parse(b'{"model":"kimi-k2.5","messages":[{}],"rid":"abc","stream_options":{"x":1}}')
    body = orjson.loads(req.upstream_body(RID))  # type: ignore[attr-defined]
    assert body == {
        "model": "moonshotai/Kimi-K2.5",
        "messages": [{}],
        "rid": RID,
        "stream_options": {"x": 1},
        "return_meta_info": True,
    }
    assert req.model == "kimi-k2.5"  # type: ignore[attr-defined]


def test_meta_info_is_asked_for_non_streamed_chat_only() -> None:
    def sent(raw: bytes, route: Route = Route.CHAT) -> dict[str, object]:
        return orjson.loads(parse(raw, route).upstream_body(RID))  # type: ignore[attr-defined,no-any-return]

    assert sent(b'{"model":"m","messages":[{}],"stream":true}').get("return_meta_info") is None
    assert sent(b'{"model":"m","prompt":"x"}', Route.COMPLETIONS).get("return_meta_info") is None
    # An explicit false is overridden (the gateway strips meta_info again on the way back).
    assert sent(b'{"model":"m","messages":[{}],"return_meta_info":false}')["return_meta_info"]
    asked = parse(b'{"model":"m","messages":[{}],"return_meta_info":true,"n":3}')
    assert asked.client_wants_meta_info and asked.choices == 3  # type: ignore[attr-defined]
    default = parse(b'{"model":"m","messages":[{}],"n":"x"}')
    assert not default.client_wants_meta_info and default.choices == 1  # type: ignore[attr-defined]


def test_max_tokens_clamp_and_default() -> None:
    clamp = parse(b'{"model":"m","messages":[{}],"max_tokens":99999}', max_tokens_cap=10)
    assert orjson.loads(clamp.upstream_body(RID))["max_tokens"] == 10  # type: ignore[attr-defined]
    default = parse(b'{"model":"m","prompt":"x"}', Route.COMPLETIONS, default_max_tokens=7)
    assert orjson.loads(default.upstream_body(RID))["max_tokens"] == 7  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"nope",
        b'"str"',
        b'{"model":""}',
        b'{"model":"m","messages":[]}',
        b'{"model":"m","messages":[{}],"user":1}',
        b'{"model":"m","messages":[{}],"max_tokens":true}',
        b'{"model":"m","messages":[{}],"max_tokens":0}',
    ],
)
def test_rejects(raw: bytes) -> None:
    with pytest.raises(InvalidRequest):
        parse(raw)


def test_too_many_messages() -> None:
    with pytest.raises(InvalidRequest, match="at most"):
        parse(b'{"model":"m","messages":[{},{},{}]}', max_messages=2)
