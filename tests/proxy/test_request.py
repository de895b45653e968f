from __future__ import annotations

import contextlib
import logging
import tracemalloc
from typing import Any

import orjson
import pytest

from app.errors import InvalidRequest
from app.limits.config import LimitsConfig
from app.proxy.fields import DENIED
from app.proxy.request import ParsedRequest, Route, parse_request

ALIASES = {"kimi-k2.5": "moonshotai/Kimi-K2.5"}
RID = "0123456789abcdef0123456789abcdef"


def parse(raw: bytes, route: Route = Route.CHAT, **limits: Any) -> ParsedRequest:
    return parse_request(raw, route, limits=LimitsConfig(**limits), aliases=ALIASES)


def sent(raw: bytes, route: Route = Route.CHAT, **limits: Any) -> dict[str, Any]:
    """What the worker receives (parsed back)."""
    return orjson.loads(parse(raw, route, **limits).upstream_body(RID))  # type: ignore[no-any-return]


def refused(raw: bytes, route: Route = Route.CHAT, **limits: Any) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as info:
        parse(raw, route, **limits)
    assert info.value.status == 400
    return info.value


def test_original_bytes_are_kept_and_rid_appended() -> None:
    raw = (
        b'{"model": "m",  "messages": [{"role": "user", "content": "hi"}], "temperature": 1.50,'
        b' "max_tokens": 7}\n'
    )
    body = parse(raw).upstream_body(RID)
    assert body.startswith(raw.rstrip()[:-1])  # untouched client bytes (even "1.50")
    # Non-streamed chat: the gateway asks for meta_info (the exact acceptance length).
    assert orjson.loads(body) == {**orjson.loads(raw), "return_meta_info": True, "rid": RID}


def test_stream_forces_usage_and_remembers_the_client_did_not_ask() -> None:
    req = parse(b'{"model":"m","messages":[{}],"stream":true}')
    assert orjson.loads(req.upstream_body(RID))["stream_options"] == {"include_usage": True}
    assert req.client_wants_usage is False
    # The client's own stream options SGLang knows are kept; others are not forwarded.
    options = b'{"continuous_usage_stats":true,"include_usage":false,"x":1}'
    raw = b'{"model":"m","messages":[{}],"stream":true,"stream_options":' + options + b"}"
    forced = sent(raw)["stream_options"]
    assert forced == {"include_usage": True, "continuous_usage_stats": True}


def test_alias_rebuilds_from_the_clients_raw_spans() -> None:
    raw = (
        b'{"model":"kimi-k2.5","messages":[{"content":"x"}],"temperature":1.50,"stop":["\\u00e9"]}'
    )
    req = parse(raw)
    body = req.upstream_body(RID)
    assert b'"temperature":1.50' in body and b'"stop":["\\u00e9"]' in body  # not re-serialised
    assert orjson.loads(body) == {
        "model": "moonshotai/Kimi-K2.5",
        "messages": [{"content": "x"}],
        "temperature": 1.5,
        "stop": ["é"],
        "max_tokens": 16384,
        "return_meta_info": True,
        "rid": RID,
    }
    assert req.model == "kimi-k2.5"


def test_meta_info_is_asked_for_non_streamed_chat_only() -> None:
    assert sent(b'{"model":"m","messages":[{}],"stream":true}').get("return_meta_info") is None
    assert sent(b'{"model":"m","prompt":"x"}', Route.COMPLETIONS).get("return_meta_info") is None
    # An explicit false is overridden (the gateway strips meta_info again on the way back).
    assert sent(b'{"model":"m","messages":[{}],"return_meta_info":false}')["return_meta_info"]
    asked = parse(b'{"model":"m","messages":[{}],"return_meta_info":true,"n":3}')
    assert asked.client_wants_meta_info and asked.choices == 3
    default = parse(b'{"model":"m","messages":[{}],"n":null}')
    assert not default.client_wants_meta_info and default.choices == 1


def test_max_tokens_clamp_and_default() -> None:
    clamp = sent(b'{"model":"m","messages":[{}],"max_tokens":99999}', max_tokens_cap=10)
    assert clamp["max_tokens"] == 10
    default = sent(b'{"model":"m","prompt":"x"}', Route.COMPLETIONS, default_max_tokens=7)
    assert default["max_tokens"] == 7
    # A duplicate key cannot slip past the cap: the worker sees one value, the clamped one.
    twice = parse(b'{"model":"m","messages":[{}],"max_tokens":5,"max_tokens":99999}').upstream_body(
        RID
    )
    assert twice.count(b'"max_tokens"') == 1 and orjson.loads(twice)["max_tokens"] == 32768


def test_omitting_max_tokens_is_not_unbounded() -> None:
    """Documented default (limits.default_max_tokens = 16384), never more than the cap; the
    OpenAI alias max_completion_tokens counts as set, and is capped the same way."""
    assert LimitsConfig().default_max_tokens == 16384
    assert sent(b'{"model":"m","messages":[{}]}')["max_tokens"] == 16384
    assert sent(b'{"model":"m","prompt":"x"}', Route.COMPLETIONS)["max_tokens"] == 16384
    assert sent(b'{"model":"m","messages":[{}]}', max_tokens_cap=100)["max_tokens"] == 100
    alias = sent(b'{"model":"m","messages":[{}],"max_completion_tokens":64}')
    assert alias["max_completion_tokens"] == 64 and "max_tokens" not in alias
    big = sent(b'{"model":"m","messages":[{}],"max_completion_tokens":999999}')
    assert big["max_completion_tokens"] == 32768
    unset = sent(b'{"model":"m","messages":[{}]}', default_max_tokens=None)
    assert "max_tokens" not in unset


def test_n_is_bounded() -> None:
    err = refused(b'{"model":"m","messages":[{}],"n":100000}')
    assert err.param == "n" and "at most 8" in err.message
    assert parse(b'{"model":"m","messages":[{}],"n":8}').choices == 8
    assert parse(b'{"model":"m","messages":[{}],"n":9}', max_n=16).choices == 9
    err = refused(b'{"model":"m","prompt":"x","best_of":50}', Route.COMPLETIONS)
    assert err.param == "best_of"
    batch = b'{"model":"m","prompt":["a","b","c"]}'
    assert refused(batch, Route.COMPLETIONS, max_n=2).param == "prompt"


@pytest.mark.parametrize(
    "value", [b"100.0", b'"100"', b"1e2", b"99999999999999999999", b"0", b"-1"]
)
def test_n_that_is_not_a_plain_positive_integer_is_refused(value: bytes) -> None:
    """A worker reads 100.0 or "100" as 100: anything but a JSON integer would get past max_n."""
    err = refused(b'{"model":"m","messages":[{}],"n":%s}' % value)
    assert err.param == "n" and err.status == 400
    err = refused(b'{"model":"m","prompt":"x","best_of":%s}' % value, Route.COMPLETIONS)
    assert err.param == "best_of"


@pytest.mark.parametrize("name", sorted(DENIED))
def test_denied_fields_are_refused_by_name(name: str) -> None:
    raw = b'{"model":"m","messages":[{}],"' + name.encode() + b'":"x"}'
    err = refused(raw)
    assert err.param == name and name in err.message
    # ...unless the operator allows it (e.g. lora_path on a multi-LoRA fleet); rid never.
    if name != "rid":
        assert sent(raw, extra_fields=(name,))[name] == "x"


def test_custom_logit_processor_is_refused_on_completions_too() -> None:
    raw = b'{"model":"m","prompt":"x","custom_logit_processor":"{\\"callable\\": \\"...\\"}"}'
    assert refused(raw, Route.COMPLETIONS).param == "custom_logit_processor"


def test_a_dropped_field_is_logged_at_debug_by_name(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG, logger="app.proxy.request"):
        parse(b'{"model":"m","messages":[{}],"frobnicate":1}')
    assert "'frobnicate'" in caplog.text and "dropped" in caplog.text


def test_unknown_fields_are_dropped_and_known_ones_kept() -> None:
    raw = (
        b'{"model":"m","messages":[{"role":"user","content":"q"}],"foo":{"a":[1,{"b":2}]},'
        b'"chat_template_kwargs":{"thinking":false},"top_k":20,"zzz":1}'
    )
    req = parse(raw)
    body = orjson.loads(req.upstream_body(RID))
    assert "foo" not in body and "zzz" not in body
    assert body["chat_template_kwargs"] == {"thinking": False} and body["top_k"] == 20
    assert req.dropped == "foo"
    assert parse(raw, extra_fields=("foo",)).dropped == "zzz"
    assert parse(b'{"model":"m","messages":[{}],"top_p":1}').dropped is None
    # The completions route drops chat-only fields, and the reverse.
    assert "messages" not in sent(b'{"model":"m","prompt":"x","messages":[]}', Route.COMPLETIONS)
    assert "prompt" not in sent(b'{"model":"m","messages":[{}],"prompt":"x"}')


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"nope",
        b'"str"',
        b"[]",
        b'{"model":"m","messages":[{}]} x',
        b'{"model":""}',
        b'{"model":5,"messages":[{}]}',
        b'{"model":"m","messages":[]}',
        b'{"model":"m","messages":{}}',
        b'{"model":"m","messages":[{}],"user":1}',
        b'{"model":"m","messages":[{}],"stream":"yes"}',
        b'{"model":"m","messages":[{}],"stream_options":[]}',
        b'{"model":"m","messages":[{}],"stream_options":{"include_usage":1}}',
        b'{"model":"m","messages":[{}],"max_tokens":true}',
        b'{"model":"m","messages":[{}],"max_tokens":0}',
        b'{"model":"m","messages":[{}],"max_tokens":1.0}',
        b'{"model":"m","messages":[{}],"max_completion_tokens":-1}',
        b'{"model":"m","messages":[{}],"foo":[1,}',
    ],
)
def test_rejects(raw: bytes) -> None:
    refused(raw)


def test_messages_are_checked_by_index() -> None:
    err = refused(b'{"model":"m","messages":[{},{"role":"robot"}]}')
    assert err.param == "messages.1.role" and "one of" in err.message
    err = refused(b'{"model":"m","messages":[{},{"role":5}]}')
    assert err.param == "messages.1.role"
    err = refused(b'{"model":"m","messages":[{},{},{"content":5}]}')
    assert err.param == "messages.2.content"
    assert refused(b'{"model":"m","messages":[{},3]}').message.startswith("messages: every")
    ok = b'{"model":"m","messages":[{"content":null},{"content":[{"type":"text","text":"x"}]}]}'
    assert parse(ok).choices == 1


@pytest.mark.parametrize(
    "prompt",
    [b'"x"', b'["a",""]', b"[1, 2, -3]", b"[[1],[2, 3]]", b'[ "a" ]', b"[\n1\n]"],
)
def test_prompt_forms(prompt: bytes) -> None:
    parse(b'{"model":"m","prompt":' + prompt + b"}", Route.COMPLETIONS)


@pytest.mark.parametrize(
    "prompt", [b'""', b"[]", b"[ ]", b"5", b"null", b'["a",1]', b"[[]]", b"[1.5]", b"[[1],[]]"]
)
def test_bad_prompts(prompt: bytes) -> None:
    err = refused(b'{"model":"m","prompt":' + prompt + b"}", Route.COMPLETIONS)
    assert err.param == "prompt"


def test_too_many_messages() -> None:
    err = refused(b'{"model":"m","messages":[{},{},{}]}', max_messages=2)
    assert "at most 2" in err.message
    parse(b'{"model":"m","messages":[{},{}],"x":{"y":{}}}', max_messages=2)  # braces elsewhere


def _peak(raw: bytes, route: Route = Route.CHAT) -> int:
    """Peak bytes Python allocates to parse ``raw`` and build one upstream body."""
    tracemalloc.start()
    try:
        with contextlib.suppress(InvalidRequest):
            parse(raw, route).upstream_body(RID)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


SMALL = b'{"type":"text","text":"a"},'


@pytest.mark.parametrize(
    "raw",
    [
        # One message whose content is many small objects.
        b'{"model":"m","messages":[{"role":"user","content":['
        + SMALL * 300_000
        + b'{"type":"text","text":"a"}]}]}',
        # Far more messages than allowed: refused before they become objects.
        b'{"model":"m","messages":[' + b'{"role":"user"},' * 500_000 + b"{}]}",
        # Many unknown top-level fields (dropped) and a large unknown nested value.
        b'{"model":"m","messages":[{}],'
        + b"".join(b'"k%d":0,' % i for i in range(600_000))
        + b'"tools":['
        + SMALL * 100_000
        + b"{}]}",
    ],
    ids=["content-parts", "too-many-messages", "unknown-fields"],
)
def test_many_small_objects_cost_about_the_body_size(raw: bytes) -> None:
    """An 8 MiB body of many small objects is not turned into Python objects: parsing and one
    upstream body stay within twice the body's size (it was 20-30 times)."""
    assert len(raw) > 6 * 1024 * 1024
    assert _peak(raw) <= 2 * len(raw)


def test_token_id_prompt_costs_about_its_size() -> None:
    raw = b'{"model":"m","prompt":[' + b"151643," * 1_200_000 + b"1]}"
    assert _peak(raw, Route.COMPLETIONS) <= 2 * len(raw)


def test_a_repeated_key_counts_by_its_last_value_as_for_the_worker() -> None:
    req = parse(b'{"model":1,"model":"kimi-k2.5","messages":[{}],"stream":"x","stream":false}')
    body = req.upstream_body(RID)
    assert req.served_model == "moonshotai/Kimi-K2.5" and not req.stream
    assert body.count(b'"model"') == 1 and body.count(b'"stream"') == 1
    assert orjson.loads(body)["model"] == "moonshotai/Kimi-K2.5"


def test_max_tokens_beyond_64_bits_is_refused() -> None:
    err = refused(b'{"model":"m","messages":[{}],"max_tokens":1' + b"0" * 30 + b"}")
    assert err.param == "max_tokens"


@pytest.mark.parametrize(
    "raw",
    [
        b'{"model":"m","messages":[{"role":"user","content":"hi"}]}',  # the client's bytes + tail
        b'{"model":"m","messages":[{"role":"user","content":"hi"}],"surprise":1}',  # rebuilt
        b'{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true}',  # patched
    ],
)
def test_the_priority_class_goes_upstream_only_when_given(raw: bytes) -> None:
    req = parse(raw)
    assert "priority" not in orjson.loads(req.upstream_body(RID))
    for value in (0, 1, 2):
        body = orjson.loads(req.upstream_body(RID, value))
        assert (body["priority"], body["rid"], body["model"]) == (value, RID, "m")
