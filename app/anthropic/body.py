"""A Messages request's body as Python objects, bounded before and after decoding.

A body that would cost far more memory decoded than its size, or that nests deeper than any
conversation needs, is a 400 before the translation (``app.anthropic.request``) reads it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import msgspec
import orjson

from app.errors import InvalidRequest


def _fail(message: str, param: str | None = None) -> InvalidRequest:
    return InvalidRequest(message, param=param)


# What a body may cost once decoded: 3x its size, plus a little for small bodies of any shape.
SIZE_FACTOR = 3
SIZE_SLACK = 4 * 1024 * 1024
# How deep a body's values may nest (objects and arrays, the body itself included): far more than
# any conversation or tool schema needs, and within what the chat body's encoder takes (254).
MAX_DEPTH = 64
# Digits as "0", anything else as " ": a run of 19 "0"s is a number past 64 bits (or digits in
# a string), found at C speed (a regular expression takes 5 times as long).
_DIGITS = bytes(0x30 if 0x30 <= i <= 0x39 else 0x20 for i in range(256))
_BIG_INT = b"0" * 19


def load(raw: bytes) -> dict[str, Any]:
    """The body as Python objects, bounded before they exist: what decoding would cost is
    estimated from the bytes that make containers, strings and separators (an upper bound, from
    ``bytes.count``), and a body that would cost more than ``SIZE_FACTOR`` times its size (plus
    ``SIZE_SLACK``) is refused. Decoded by msgspec (no transient buffers; orjson, which reads a
    number past 64 bits as a float as the chat body's encoder needs, when the bytes hold a run
    of 19 digits). Then no value may nest deeper than ``MAX_DEPTH`` (the 400 names where)."""
    if len(raw) > SIZE_SLACK // 100 and _decoded_size(raw) > SIZE_FACTOR * len(raw) + SIZE_SLACK:
        raise _fail(
            "request body holds too many JSON values for its size (objects, arrays, strings "
            f"or numbers); at most {SIZE_FACTOR} times its size once decoded"
        )
    try:
        if _has_big_int(raw):
            body = orjson.loads(raw)
        else:
            try:
                body = msgspec.json.decode(raw)
            except RecursionError:  # orjson reads deeper (1024 levels): the 400 can say where
                body = orjson.loads(raw)
    except (orjson.JSONDecodeError, msgspec.DecodeError):
        raise _fail("request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise _fail("request body must be a JSON object")
    where = _too_deep(body, MAX_DEPTH)
    if where is not None:
        raise _fail(f"{where}: nests more than {MAX_DEPTH} levels deep", where)
    return body


def _has_big_int(raw: bytes, window: int = 1 << 16) -> bool:
    """Whether ``raw`` holds a run of 19 digits, read in windows (no copy of a large body)."""
    view = memoryview(raw)
    step = window - len(_BIG_INT)
    return any(
        _BIG_INT in bytes(view[at : at + window]).translate(_DIGITS)
        for at in range(0, max(len(raw) - len(_BIG_INT), 0) + 1, step)
    )


def _decoded_size(raw: bytes) -> int:
    """An upper bound on the bytes ``raw`` takes as Python objects (measured on CPython 3.11:
    about 70-190 bytes per object or array, 55 per string, 8-32 per element, and the text)."""
    containers = raw.count(b"{") + raw.count(b"[")
    quotes = raw.count(b'"')  # two per string (escaped ones count too: an over-estimate)
    separators = raw.count(b",") + raw.count(b":")
    return len(raw) + 100 * containers + 28 * quotes + 16 * separators


def _too_deep(body: dict[str, Any], limit: int) -> str | None:
    """Where (``field.0.key``, up to 5 steps) a value first nests past ``limit`` levels; None
    when none does. Depth first, one iterator per level: what the walk holds is bounded by the
    depth, not by the body's size."""
    stack: list[Iterator[tuple[Any, Any]]] = [iter(body.items())]
    keys: list[Any] = []  # the path to the container whose iterator is on top
    while stack:
        for key, item in stack[-1]:
            if isinstance(item, dict | list):
                if len(stack) + 1 > limit:
                    return ".".join(map(str, [*keys, key][:5]))
                keys.append(key)
                stack.append(iter(item.items()) if isinstance(item, dict) else enumerate(item))
                break
        else:
            stack.pop()
            if keys:
                keys.pop()
    return None
