"""The body sent upstream: the client's bytes with the gateway's own fields spliced in.

The gateway sends the client's ORIGINAL bytes with the fields it must set appended before the
closing brace (``rid`` always; ``priority`` when the workers schedule by priority;
``max_tokens``/``stream_options``/``return_meta_info`` when it has to). When the body held a
field the gateway drops or replaces, the upstream body is the raw spans of the kept fields joined
with the gateway's own: no re-serialisation either way. ``upstream_head`` is that body up to
where each attempt's ``"rid":"..."}`` goes (``ParsedRequest.upstream_parts``).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from typing import Any

import msgspec

from app.proxy.fields import ABSENT, Schema
from app.tenants.config import PRIORITIES

# SGLang's ``priority`` field of each class value, ahead of an attempt's ``rid``.
PRIORITY_FIELDS = {value: b'"priority":%d,' % value for value in PRIORITIES.values()}
_FIELDS = msgspec.json.Decoder(dict[str, msgspec.Raw])


def upstream_head(
    raw: bytes, body: Any, spans: Any, schema: Schema, patch: dict[str, bytes]
) -> tuple[memoryview | bytes, ...]:
    """Upstream body up to where ``"rid":"..."}`` goes (ends with ``{`` or ``,``)."""
    tail = b"".join([b'"%s":%s,' % (name.encode(), value) for name, value in patch.items()])
    if spans is None and all(_missing(getattr(body, name)) for name in patch):
        # Common case: the client's bytes, untouched, with the new fields appended.
        end = len(raw) - 1 if raw[-1] == 125 else raw.rfind(b"}")  # 125: "}"
        while raw[end - 1] in b" \t\r\n":
            end -= 1
        separator = b"" if raw[end - 1] == ord("{") else b","
        return (memoryview(raw)[:end], separator + tail)
    # The client's fields as it wrote them (those the gateway keeps), then the gateway's own.
    # Every key of a body ``schema.typed`` read is an allowed name: a dict of them stays small
    # (a repeated key replaces its value).
    parts = (
        field_spans(spans, schema, patch) if spans else _items(_FIELDS.decode(raw), schema, patch)
    )
    if parts:
        parts[0] = b"{" + parts[0][1:]  # the first key, without its comma
        parts.append(b",")
    else:
        parts.append(b"{")
    parts.append(tail)
    return tuple(parts)


def _items(body: dict[str, msgspec.Raw], schema: Schema, skip: Mapping[str, bytes]) -> list[Any]:
    """``,"name":value`` for each field of ``body`` (all allowed names) not in ``skip``."""
    key_of = schema.key_of
    parts: list[Any] = []
    for name, value in body.items():
        if name not in skip:
            parts += (key_of[name], value)
    return parts


def _missing(value: Any) -> bool:
    """A field the client left out (defaults are never copies: identity tells)."""
    return value is msgspec.UNSET or value is ABSENT


def field_spans(spans: Any, schema: Schema, skip: Mapping[str, bytes]) -> list[Any]:
    """``,"name":value`` for each field present in ``spans`` and not in ``skip``."""
    parts: list[Any] = []
    values = msgspec.structs.astuple(spans)
    for i in itertools.compress(range(len(values)), map(len, values)):
        if schema.names[i] not in skip:
            parts += (schema.keys[i], values[i])
    return parts
