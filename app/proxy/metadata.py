"""``metadata``: the key-value pairs a request may tag itself with, bounded as OpenAI bounds them
on every surface that takes them (chat and text completions, Responses, Messages).

At most ``MAX_PAIRS`` pairs, each key a string of at most ``MAX_KEY_CHARS`` characters and each
value a string of at most ``MAX_VALUE_CHARS``; anything else is a 400 naming ``metadata``. The
values do not change an answer, but a Response stores and repeats them (three times in a stream),
so unbounded ones would let a cheap request cost another key its stored responses. A chat body's
``metadata`` is checked from its raw span: one too long to hold valid metadata is refused before
it is decoded.
"""

from __future__ import annotations

from typing import Any

import msgspec

from app.errors import InvalidRequest

MAX_PAIRS = 16
MAX_KEY_CHARS = 64
MAX_VALUE_CHARS = 512
# The longest JSON valid metadata can take: every character escaped as a surrogate pair
# (``\ud83d\ude00``, 12 bytes), plus quotes, colons, commas and braces.
MAX_RAW_BYTES = MAX_PAIRS * ((MAX_KEY_CHARS + MAX_VALUE_CHARS) * 12 + 6) + 2
_DECODE = msgspec.json.Decoder(dict[str, Any] | None)
_RULE = (
    f"at most {MAX_PAIRS} pairs, keys of at most {MAX_KEY_CHARS} characters, string values of "
    f"at most {MAX_VALUE_CHARS}"
)


def _fail(what: str, param: str) -> InvalidRequest:
    return InvalidRequest(f"{param}: {what} ({_RULE})", param=param)


def check_metadata(value: Any, *, param: str = "metadata", nulls: bool = False) -> None:
    """A 400 unless ``value`` is None or bounded metadata (``nulls``: a value may be null, as
    Anthropic's ``metadata.user_id`` may)."""
    if value is None:
        return
    if not isinstance(value, dict):
        raise _fail("must be an object", param)
    if len(value) > MAX_PAIRS:
        raise _fail(f"{len(value)} pairs", param)
    for key, item in value.items():
        if len(key) > MAX_KEY_CHARS:
            raise _fail(f"a key of {len(key)} characters", param)
        if item is None and nulls:
            continue
        if not isinstance(item, str):
            raise _fail(f"the value of {key[:MAX_KEY_CHARS]!r} is not a string", param)
        if len(item) > MAX_VALUE_CHARS:
            raise _fail(f"the value of {key!r} has {len(item)} characters", param)


def check_raw_metadata(raw: bytes | memoryview) -> None:
    """``check_metadata`` for the raw JSON span of a body's ``metadata``; a span longer than any
    valid metadata is refused without being decoded."""
    if len(raw) > MAX_RAW_BYTES:
        raise _fail(f"{len(raw)} bytes", "metadata")
    try:
        value = _DECODE.decode(raw)
    except msgspec.ValidationError:
        raise _fail("must be an object", "metadata") from None
    except msgspec.DecodeError:
        raise _fail("is not valid JSON", "metadata") from None
    check_metadata(value)
