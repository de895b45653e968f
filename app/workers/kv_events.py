"""KV events from workers: the typed events, the sink that receives them, and the wire decoder.

SGLang (``--kv-events-config``, ``srt/disaggregation/kv_events.py``) and vLLM
(``vllm/distributed/kv_events.py``) publish the changes of their prefix cache on a ZMQ PUB
socket, one multipart message per batch: ``(topic, sequence, payload)``, the sequence an 8-byte
big-endian counter from 0 per publisher, the payload msgpack of an ``EventBatch``:

* SGLang: an array ``[ts, events, attn_dp_rank]``; vLLM: a map ``{ts, events,
  data_parallel_rank}`` (older vLLM releases: an array too).
* each event a msgspec struct tagged with its class name: a map with ``type`` (both engines
  today) or, from array-like releases, an array ``[type, field, ...]`` in declaration order:
  ``BlockStored(block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, ...)``,
  ``BlockRemoved(block_hashes, medium, ...)``, ``AllBlocksCleared()``.
* block hashes: SGLang signed int64s; vLLM unsigned 64-bit ints, or 32-byte digests with
  ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`` (read as vLLM converts them: the low 64 bits).

``decode_batch`` turns a payload into ``KvEvent``s; ``app.workers.kv_subscriber`` reads the
sockets, checks the sequence and hands each batch to a ``KvEventSink`` with ``gap=True`` when
anything may have been missed before it (the first batch after (re)connecting, a skipped or
restarted sequence, an undecodable batch): the sink must then treat what it knew of that
worker's cache as unknown. Hashes are the engine's own (over its token ids at its page size): to
match a prompt against them a router needs that prompt's token ids (docs/routing.md, "KV
events").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import msgspec

_U64 = (1 << 64) - 1


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[int, ...]
    block_size: int


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KvEventSink(Protocol):
    def kv_events(self, worker_url: str, events: Sequence[KvEvent], *, gap: bool) -> None: ...


class BadBatch(ValueError):
    """A payload that is not an ``EventBatch`` of known events."""


@dataclass(frozen=True, slots=True)
class Batch:
    ts: float
    events: tuple[KvEvent, ...]
    rank: int | None


_decoder = msgspec.msgpack.Decoder()


def _hash(value: Any) -> int:
    if isinstance(value, bool):
        raise BadBatch("a block hash is a boolean")
    if isinstance(value, int):
        return value
    if isinstance(value, bytes | bytearray):
        return int.from_bytes(value, "big") & _U64
    raise BadBatch(f"a block hash is a {type(value).__name__}")


def _hashes(value: Any) -> tuple[int, ...]:
    if not isinstance(value, list):
        raise BadBatch("block_hashes is not a list")
    return tuple(_hash(v) for v in value)


def _int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadBatch(f"{what} is not an integer")
    return value


def _tokens(value: Any) -> tuple[int, ...]:
    if not isinstance(value, list):
        raise BadBatch("token_ids is not a list")
    # SGLang's bigram (EAGLE) pages carry (token, next) pairs: the first is the page's token.
    return tuple(_int(v[0] if isinstance(v, list) and v else v, "a token id") for v in value)


_FIELDS = {
    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size"),
    "BlockRemoved": ("block_hashes",),
    "AllBlocksCleared": (),
}


def _fields(raw: Any) -> tuple[str, dict[str, Any]]:
    """An event's tag and fields, from a tagged map or a tagged array."""
    if isinstance(raw, dict):
        tag = raw.get("type")
        if not isinstance(tag, str) or tag not in _FIELDS:
            raise BadBatch(f"unknown event type {tag!r}")
        return tag, raw
    if isinstance(raw, list) and raw and isinstance(raw[0], str) and raw[0] in _FIELDS:
        names = _FIELDS[raw[0]]
        if len(raw) < 1 + len(names):
            raise BadBatch(f"{raw[0]} has too few fields")
        return raw[0], dict(zip(names, raw[1:], strict=False))
    raise BadBatch("an event is neither a tagged map nor a tagged array")


def decode_event(raw: Any) -> KvEvent:
    tag, f = _fields(raw)
    if tag == "BlockStored":
        parent = f.get("parent_block_hash")
        return BlockStored(
            block_hashes=_hashes(f.get("block_hashes")),
            parent_block_hash=None if parent is None else _hash(parent),
            token_ids=_tokens(f.get("token_ids")),
            block_size=_int(f.get("block_size"), "block_size"),
        )
    if tag == "BlockRemoved":
        return BlockRemoved(block_hashes=_hashes(f.get("block_hashes")))
    return AllBlocksCleared()


def decode_batch(payload: bytes) -> Batch:
    """One ``EventBatch`` payload (either engine's encoding); ``BadBatch`` if it is not one."""
    try:
        raw = _decoder.decode(payload)
    except msgspec.DecodeError as exc:
        raise BadBatch(f"not msgpack: {exc}") from exc
    if isinstance(raw, list) and len(raw) >= 2:
        ts, events, rank = raw[0], raw[1], raw[2] if len(raw) > 2 else None
    elif isinstance(raw, dict):
        ts, events = raw.get("ts"), raw.get("events")
        rank = raw.get("data_parallel_rank", raw.get("attn_dp_rank"))
    else:
        raise BadBatch("the payload is not an EventBatch")
    if isinstance(ts, bool) or not isinstance(ts, int | float) or not isinstance(events, list):
        raise BadBatch("the payload is not an EventBatch")
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int)):
        raise BadBatch("the batch's rank is not an integer")
    return Batch(float(ts), tuple(decode_event(e) for e in events), rank)


def sequence_number(frame: bytes) -> int:
    if len(frame) != 8:
        raise BadBatch("the sequence frame is not 8 bytes")
    return int.from_bytes(frame, "big", signed=True)


class KvEventSinks:
    """Hands every batch to each of ``sinks`` in turn (the counters, the routing index)."""

    def __init__(self, sinks: Sequence[KvEventSink]) -> None:
        self._sinks = tuple(sinks)

    def kv_events(self, worker_url: str, events: Sequence[KvEvent], *, gap: bool) -> None:
        for sink in self._sinks:
            sink.kv_events(worker_url, events, gap=gap)
