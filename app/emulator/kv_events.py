"""KV events: the emulated worker publishes its prefix cache's changes as SGLang or vLLM does.

``--kv-events-config '{"publisher": "zmq", "endpoint": "tcp://*:5557", "topic": "kv-events"}'``
(SGLang's and vLLM's flag; ``"bind": true`` binds a concrete address such as loopback, as SGLang's
``KVEventsConfig.bind``; without it only a wildcard host is bound and any other is connected to,
the engines' heuristic). Every cache change (``app.emulator.cache``: pages stored after a prefill,
pages evicted, ``/flush_cache``) is one batch on a ZMQ PUB socket, as a multipart message
``(topic, sequence as 8-byte big-endian, msgpack payload)``, the sequence counting from 0 per
process (``ZmqEventPublisher._publisher_thread`` in both engines).

Payloads, from the engines' own classes (msgspec structs; events are tagged by class name under
``type``, ``None`` optionals left out):

* SGLang 0.5.23 (``srt/disaggregation/kv_events.py``): the batch is an array
  ``[ts, events, attn_dp_rank]``; events are maps: ``BlockStored{block_hashes, parent_block_hash,
  token_ids, block_size, lora_id, medium}``, ``BlockRemoved{block_hashes, medium}``,
  ``AllBlocksCleared{}``. Hashes are SGLang's: SHA-256 chained over each page's token ids (uint32
  little-endian), first 8 bytes as a signed int64 (``mem_cache/utils.py`` ``hash_str_to_int64``).
* vLLM (``vllm/distributed/kv_events.py``): the batch is a map ``{ts, events,
  data_parallel_rank}``; ``BlockStored`` also carries ``lora_name`` (``None`` as it has no
  default), ``BlockRemoved{block_hashes, medium}``; hashes are unsigned 64-bit ints
  (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``, on by default): the emulator sends its page hash's
  8 bytes unsigned.

Not emulated: the replay ROUTER socket (``replay_endpoint``), the ``load`` topic, data-parallel
ranks beyond 0. The token ids are the emulator's (4 characters a token: ``cache.page_token_ids``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import msgspec
import orjson

from app.emulator.cache import CacheEvent, Cleared, Removed, Stored

MEDIUM_GPU = "GPU"
_WILDCARDS = ("*", "0.0.0.0", "::", "[::]")


class _SGLangBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[Any]
    attn_dp_rank: int | None = None


class _VLLMBatch(msgspec.Struct, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class _Event(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class _SGLangStored(_Event, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None = None
    cache_salt: str | None = None
    session_id: str | None = None
    lora_name: str | None = None


class _VLLMStored(_Event, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class _SGLangRemoved(_Event, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None = None


class _VLLMRemoved(_Event, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None


class _Cleared(_Event, tag="AllBlocksCleared"):
    pass


@dataclass(frozen=True)
class KvEventsConfig:
    """The parts of ``--kv-events-config`` the emulator serves."""

    publisher: str = "null"
    endpoint: str = "tcp://*:5557"
    topic: str = ""
    bind: bool | None = None

    @classmethod
    def parse(cls, raw: str) -> KvEventsConfig:
        try:
            data = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise ValueError(f"--kv-events-config is not JSON: {exc}") from exc
        if not isinstance(data, dict):
            raise ValueError("--kv-events-config must be a JSON object")
        publisher = data.get("publisher", "null")
        if publisher not in ("null", "zmq"):
            raise ValueError(f"unknown KV events publisher {publisher!r}; one of null, zmq")
        endpoint, topic, bind = data.get("endpoint", cls.endpoint), data.get("topic", ""), None
        if not isinstance(endpoint, str) or not isinstance(topic, str):
            raise ValueError("--kv-events-config: endpoint and topic are strings")
        if "bind" in data and data["bind"] is not None:
            bind = bool(data["bind"])
        return cls(publisher=publisher, endpoint=endpoint, topic=topic, bind=bind)

    @property
    def enabled(self) -> bool:
        return self.publisher == "zmq"

    def host_port(self) -> tuple[str, int] | None:
        """``(host, port)`` of a ``tcp://`` endpoint, else None."""
        if not self.endpoint.startswith("tcp://"):
            return None
        host, sep, port = self.endpoint[len("tcp://") :].rpartition(":")
        if not sep or not port.isdigit() or not 0 < int(port) <= 65535:
            return None
        return host, int(port)

    def binds(self) -> bool:
        if self.bind is not None:
            return self.bind
        address = self.host_port()
        return address is not None and address[0] in _WILDCARDS

    def describe(self, block_size: int) -> dict[str, Any] | None:
        """``/server_info``'s ``kv_events`` block (``runtime_context.py``
        ``describe_kv_events_publisher``): where to subscribe, at which block size."""
        address = self.host_port()
        if not self.enabled or address is None:
            return None
        return {
            "publisher": self.publisher,
            "endpoint_host": address[0],
            "endpoint_port_base": address[1],
            "topic": self.topic,
            "block_size": block_size,
            "dp_size": 1,
        }


class KvEventPublisher:
    """A ZMQ PUB socket and the sequence; ``publish`` is the prefix cache's recorder."""

    def __init__(self, config: KvEventsConfig, engine: str, block_size: int) -> None:
        import zmq

        self._vllm = engine == "vllm"
        self._block_size = block_size
        self._topic = config.topic.encode()
        self._seq = 0
        self._encoder = msgspec.msgpack.Encoder()
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.PUB)
        self._socket.set_hwm(100_000)
        self._socket.setsockopt(zmq.LINGER, 0)
        try:
            if config.binds():
                self._socket.bind(config.endpoint)
            else:
                self._socket.connect(config.endpoint)
        except zmq.ZMQError as exc:
            self.close()
            raise OSError(f"cannot bind or connect {config.endpoint}: {exc}") from exc
        self._noblock = zmq.NOBLOCK

    def _event(self, event: CacheEvent) -> _Event:
        vllm = self._vllm
        if isinstance(event, Stored):
            hashes = [_vllm_hash(h) for h in event.hashes] if vllm else event.hashes
            parent = event.parent
            if vllm and parent is not None:
                parent = _vllm_hash(parent)
            if vllm:
                return _VLLMStored(
                    hashes, parent, event.token_ids, self._block_size, None, MEDIUM_GPU, None
                )
            return _SGLangStored(
                hashes, parent, event.token_ids, self._block_size, None, MEDIUM_GPU
            )
        if isinstance(event, Removed):
            if vllm:
                return _VLLMRemoved([_vllm_hash(h) for h in event.hashes], MEDIUM_GPU)
            return _SGLangRemoved(event.hashes, MEDIUM_GPU)
        assert isinstance(event, Cleared)
        return _Cleared()

    def publish(self, events: list[CacheEvent]) -> None:
        body = [self._event(e) for e in events]
        batch: _SGLangBatch | _VLLMBatch = (
            _VLLMBatch(time.time(), body, 0) if self._vllm else _SGLangBatch(time.time(), body, 0)
        )
        payload = self._encoder.encode(batch)
        # A PUB socket never blocks: beyond the high-water mark a subscriber misses the batch
        # (and sees the gap in the sequence).
        self._socket.send_multipart(
            (self._topic, self._seq.to_bytes(8, "big"), payload), flags=self._noblock
        )
        self._seq += 1

    def close(self) -> None:
        self._socket.close(linger=0)
        self._context.term()


def _vllm_hash(int64: int) -> int:
    """The emulator keeps SGLang's signed int64 per page; vLLM's wire form is unsigned."""
    return int64 & ((1 << 64) - 1)
