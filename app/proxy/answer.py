"""A non-streamed answer read for what the gateway needs, without building its document.

``read_answer(body, strip=...)`` decodes only ``usage`` and each choice's ``meta_info`` (msgspec,
typed; every other field is skipped, still checked to be JSON) and, when ``strip``, cuts the
``meta_info`` members out of the worker's bytes: the client gets the worker's answer byte for
byte, less the field the gateway asked for. Returns None when the answer has another shape than
SGLang's (not an object, ``choices`` not a list of objects, ``usage`` or ``meta_info`` not an
object, a ``"meta_info"`` key anywhere but once per choice): the caller then reads it as a
document, as before.

Finding the members in the bytes: in JSON text a ``"`` byte is either a string's delimiter or
escaped (after an odd run of backslashes), and UTF-8 never uses the bytes of ``"`` or ``\\``
inside a multi-byte character. So ``"meta_info"`` whose first quote is a delimiter is that string
itself, and a key when a ``:`` follows; text inside a string value that reads the same carries
escaped quotes and never matches. Each key found must be followed by the bytes msgspec read as
the next choice's ``meta_info`` value (``msgspec.Raw``, a view of the body), which also gives the
member's end without scanning the value.
"""

from __future__ import annotations

from typing import Any

import msgspec

from app.upstream.sse import answers, foreign
from app.upstream.usage import Usage, reported_count

_KEY = b'"meta_info"'
_SPACE = b" \t\r\n"


class _Meta(msgspec.Struct):
    spec_verify_ct: Any = None


class _Choice(msgspec.Struct):
    meta_info: msgspec.Raw = msgspec.Raw()  # the value's bytes; empty when absent


class _Usage(msgspec.Struct):
    prompt_tokens: Any = None
    completion_tokens: Any = None
    reasoning_tokens: Any = None
    completion_tokens_details: Any = None
    prompt_tokens_details: Any = None


class _Answer(msgspec.Struct):
    id: Any = None
    choices: list[_Choice] | None = None
    usage: _Usage | None = None


_DECODER = msgspec.json.Decoder(_Answer)
_META = msgspec.json.Decoder(_Meta | None)


class NotJSON(ValueError):
    """The body is not JSON at all."""


def read_answer(
    body: bytes, *, strip: bool, rid: str | None = None
) -> tuple[Usage | None, int | None, bytes] | None:
    """``(usage, verify steps, the client's bytes)`` of a non-streamed answer (see the module
    docstring); None for another shape; ``NotJSON`` for a body that is not JSON. ``rid``: the
    request's, which the answer's ``id`` must carry (``app.upstream.sse.answers``), else
    ``UpstreamForeignAnswer``."""
    try:
        answer = _DECODER.decode(body)
        if rid is not None and not answers(rid, answer.id):
            raise foreign(rid, answer.id)
        metas = [c.meta_info for c in answer.choices or () if len(c.meta_info)]
        steps: int | None = None
        for raw in metas:
            meta = _META.decode(raw)
            count = reported_count(meta.spec_verify_ct) if meta is not None else None
            if count is not None and count > 0:
                steps = (steps or 0) + count
    except msgspec.ValidationError:
        return None
    except (msgspec.DecodeError, RecursionError):
        raise NotJSON from None
    usage = None
    if answer.usage is not None:
        u = answer.usage
        reasoning = u.reasoning_tokens
        if reasoning is None and isinstance(u.completion_tokens_details, dict):
            reasoning = u.completion_tokens_details.get("reasoning_tokens")
        details = u.prompt_tokens_details
        usage = Usage(
            reported_count(u.prompt_tokens),
            reported_count(u.completion_tokens),
            reported_count(reasoning),
            cached_tokens=reported_count(details.get("cached_tokens"))
            if isinstance(details, dict)
            else None,
        )
    at = body.find(_KEY) if strip else -1
    if at < 0:
        return usage, steps, body
    spans = _members(body, at, metas)
    if spans is None:
        return None
    parts, at = [], 0
    for start, end in spans:
        parts.append(body[at:start])
        at = end
    parts.append(body[at:])
    return usage, steps, b"".join(parts)


def _members(body: bytes, at: int, metas: list[msgspec.Raw]) -> list[tuple[int, int]] | None:
    """The byte ranges to cut for each ``"meta_info": value`` member (``metas``: the values, in
    order; ``at``: the first ``"meta_info"`` in ``body``), with the comma that separates it from
    its neighbour; None if the keys in ``body`` are not exactly those."""
    spans: list[tuple[int, int]] = []
    values = iter(metas)
    while at >= 0:
        if _delimiter(body, at):
            colon = _skip_space(body, at + len(_KEY))
            if colon < len(body) and body[colon] == 0x3A:  # a key
                value = next(values, None)
                start = _skip_space(body, colon + 1)
                if value is None or not body.startswith(value, start):
                    return None
                end = after_value = start + len(value)
                before = _back_space(body, at)
                if before >= 0 and body[before] == 0x2C:  # ', "meta_info": ...'
                    spans.append((before, end))
                else:  # the object's first member: its following comma goes with it
                    after = _skip_space(body, end)
                    if after < len(body) and body[after] == 0x2C:
                        end = _skip_space(body, after + 1)
                    spans.append((at, end))
                at = after_value - len(_KEY)  # a key inside the value goes with it
        at = body.find(_KEY, at + len(_KEY))
    return spans if next(values, None) is None else None


def _delimiter(body: bytes, at: int) -> bool:
    """The quote at ``at`` is a string's delimiter, not an escaped one."""
    run = at
    while run > 0 and body[run - 1] == 0x5C:
        run -= 1
    return (at - run) % 2 == 0


def _skip_space(body: bytes, at: int) -> int:
    while at < len(body) and body[at] in _SPACE:
        at += 1
    return at


def _back_space(body: bytes, at: int) -> int:
    at -= 1
    while at >= 0 and body[at] in _SPACE:
        at -= 1
    return at
