"""A non-streamed answer read without building its document: the client's bytes are the worker's,
less exactly the ``meta_info`` members, and the counts match a full parse's."""

from __future__ import annotations

import orjson
import pytest

from app.proxy.answer import NotJSON, read_answer
from app.upstream.usage import parse_usage, take_meta_info

META = b'{"id":"r1","finish_reason":{"type":"stop","matched":2},"spec_verify_ct":4,"e":[1,[2]]}'
USAGE = b'"usage":{"prompt_tokens":14,"completion_tokens":12,"total_tokens":26}'


def answer(*choices: bytes, usage: bytes = USAGE) -> bytes:
    return b'{"id":"c","object":"chat.completion","choices":[%b],%b}' % (
        b",".join(choices),
        usage,
    )


def choice(index: int, content: bytes = b'"Hello!"', meta: bytes | None = META) -> bytes:
    tail = b',"meta_info":%b' % meta if meta is not None else b""
    return b'{"index":%d,"message":{"role":"assistant","content":%b},"finish_reason":"stop"%b}' % (
        index,
        content,
        tail,
    )


def same_as_a_full_parse(body: bytes) -> bytes:
    """The answer read both ways: counts equal, the stripped copy the same document."""
    read = read_answer(body, strip=True)
    assert read is not None
    usage, steps, out = read
    doc = orjson.loads(body)
    assert usage == parse_usage(doc)
    assert steps == take_meta_info(doc, strip=True)
    assert orjson.loads(out) == doc  # take_meta_info stripped doc
    return out


def test_meta_info_cut_and_the_rest_byte_identical() -> None:
    body = answer(choice(0))
    out = same_as_a_full_parse(body)
    assert out == answer(choice(0, meta=None))
    usage, steps, _ = read_answer(body, strip=True) or (None, None, b"")
    assert steps == 4 and usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens) == (14, 12)


def test_kept_when_the_client_asked_for_it() -> None:
    body = answer(choice(0))
    assert read_answer(body, strip=False) == (parse_usage(orjson.loads(body)), 4, body)


@pytest.mark.parametrize(
    "content",
    [
        # The key's text inside a string: escaped quotes, never a member.
        rb'"he wrote \"meta_info\": {\"spec_verify_ct\": 99}, then }]"',
        # A string ending in a backslash right before the real member.
        rb'"a path C:\\"',
        rb'"\\\"meta_info\\\""',
        # Unicode: escaped quotes and raw UTF-8.
        rb'"\u0022meta_info\u0022: {} \u00e9 \ud83d\ude00"',
        '"caf\u00e9 \u201cmeta_info\u201d \U0001f600"'.encode(),
        b'"meta_info"',  # the text as a whole value
    ],
)
def test_the_text_inside_strings_is_left_alone(content: bytes) -> None:
    body = answer(choice(0, content=content))
    out = same_as_a_full_parse(body)
    assert out == answer(choice(0, content=content, meta=None))


def test_every_choice_of_n() -> None:
    metas = [META, b'{"spec_verify_ct":3,"x":"}]{["}', b"null"]
    body = answer(*(choice(i, meta=m) for i, m in enumerate(metas)))
    out = same_as_a_full_parse(body)
    assert out == answer(*(choice(i, meta=None) for i in range(3)))
    assert read_answer(body, strip=True) is not None
    assert (read_answer(body, strip=True) or (None, 0, b""))[1] == 7


def test_first_only_and_spaced_members() -> None:
    first = b'{"choices":[{"meta_info" : {"spec_verify_ct":2} , "index":0}],' + USAGE + b"}"
    assert same_as_a_full_parse(first) == b'{"choices":[{"index":0}],' + USAGE + b"}"
    only = b'{"choices":[{"meta_info":{"spec_verify_ct":2}}]}'
    assert same_as_a_full_parse(only) == b'{"choices":[{}]}'
    pretty = orjson.dumps(orjson.loads(answer(choice(0), choice(1))), option=orjson.OPT_INDENT_2)
    assert b'"meta_info"' not in same_as_a_full_parse(pretty)


def test_reasoning_tokens_from_the_details() -> None:
    usage = b'"usage":{"completion_tokens":5,"completion_tokens_details":{"reasoning_tokens":3}}'
    same_as_a_full_parse(answer(choice(0), usage=usage))


@pytest.mark.parametrize(
    "body",
    [
        b"[1,2]",  # not an object
        b'"text"',
        b'{"choices":{"a":1}}',  # choices not a list
        b'{"choices":[1]}',
        b'{"choices":[{"meta_info":[1]}]}',  # meta_info not an object
        b'{"usage":"many"}',
        # A "meta_info" key elsewhere than a choice: read as a document instead.
        b'{"meta_info":{"spec_verify_ct":1},"choices":[{"meta_info":{"spec_verify_ct":2}}]}',
        b'{"choices":[{"meta_info":{"spec_verify_ct":2},"meta_info":{"spec_verify_ct":3}}]}',
    ],
)
def test_other_shapes_are_left_to_a_full_parse(body: bytes) -> None:
    assert read_answer(body, strip=True) is None


@pytest.mark.parametrize("body", [b"", b"not json", b'{"choices":[', answer(choice(0)) + b"x"])
def test_not_json(body: bytes) -> None:
    with pytest.raises(NotJSON):
        read_answer(body, strip=True)


def test_a_key_inside_meta_info_goes_with_it() -> None:
    nested = b'{"spec_verify_ct":2,"meta_info":{"spec_verify_ct":9}}'
    out = same_as_a_full_parse(answer(choice(0, meta=nested)))
    assert out == answer(choice(0, meta=None))
