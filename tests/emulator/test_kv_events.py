"""The emulator's KV events, read off its ZMQ socket on loopback: SGLang's bytes decoded by
SGLang's own event classes, vLLM's by structs in vLLM's declared field order, and the gateway's
decoder agreeing with both."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import msgspec
import orjson
import pytest
import zmq

from app.emulator.cache import sglang_block_hash
from app.workers.kv_events import AllBlocksCleared, BlockStored, decode_batch
from tests.emulator.sglang_protocol import load_kv_events
from tests.support.procs import PYTHON, ManagedProcess, ProcessManager, free_port

pytestmark = pytest.mark.processes
PAGE = 16
EMULATE = [PYTHON, "-m", "app", "emulate", "--port", "{port}", "--speed", "50"]


@pytest.fixture
def subs() -> Iterator[list[zmq.Socket[bytes]]]:
    """The test's SUB sockets, closed at teardown."""
    sockets: list[zmq.Socket[bytes]] = []
    yield sockets
    for sock in sockets:
        sock.close(linger=0)


def _start(
    procs: ProcessManager, subs: list[zmq.Socket[bytes]], *flags: str
) -> tuple[ManagedProcess, zmq.Socket[bytes]]:
    port = free_port()
    config = {
        "publisher": "zmq",
        "endpoint": f"tcp://127.0.0.1:{port}",
        "topic": "kv",
        "bind": True,
    }
    json_config = orjson.dumps(config).decode()
    emu = procs.start(
        [*EMULATE, "--page-size", str(PAGE), "--kv-events-config", json_config, *flags],
        name="emu",
    )
    sub = zmq.Context.instance().socket(zmq.SUB)
    subs.append(sub)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.setsockopt(zmq.RCVTIMEO, 10_000)
    sub.setsockopt(zmq.LINGER, 0)
    sub.connect(f"tcp://127.0.0.1:{port}")
    return emu, sub


def _settle(emu: ManagedProcess, sub: zmq.Socket[bytes]) -> None:
    """A SUB socket misses what is published before its connection is up: store new pages
    until a batch arrives, then drain."""
    for i in range(100):
        _chat(emu, f"settling {i} " * 40)
        if sub.poll(100):
            break
    else:
        raise AssertionError("no KV event batch arrived")
    while sub.poll(300):
        sub.recv_multipart()


def _chat(emu: ManagedProcess, content: str) -> dict[str, Any]:
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 2}
    response = httpx.post(f"{emu.url}/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == 200, response.text
    out: dict[str, Any] = response.json()
    return out


def test_sglang_format_decodes_with_sglang_classes(
    procs: ProcessManager, subs: list[zmq.Socket[bytes]]
) -> None:
    sglang = load_kv_events()
    emu, sub = _start(procs, subs, "--max-total-tokens", "2048")
    info = httpx.get(f"{emu.url}/server_info").json()
    assert info["kv_events"]["block_size"] == PAGE == info["page_size"]
    assert info["kv_events"]["endpoint_port_base"] > 0 and info["kv_events"]["topic"] == "kv"
    _settle(emu, sub)
    assert httpx.post(f"{emu.url}/flush_cache").status_code == 200  # the settling pages go
    _, _, payload = sub.recv_multipart()
    cleared = msgspec.msgpack.decode(payload, type=sglang.KVEventBatch).events
    assert [type(e) for e in cleared] == [sglang.AllBlocksCleared]
    assert decode_batch(payload).events == (AllBlocksCleared(),)

    text = "The quick brown fox jumps over the lazy dog. " * 40  # ~450 tokens
    usage = _chat(emu, text)["usage"]
    topic, seq, payload = sub.recv_multipart()
    assert topic == b"kv" and len(seq) == 8
    batch = msgspec.msgpack.decode(payload, type=sglang.KVEventBatch)
    assert batch.attn_dp_rank == 0 and len(batch.events) == 1
    stored = batch.events[0]
    assert isinstance(stored, sglang.BlockStored)
    pages = usage["prompt_tokens"] // PAGE
    assert len(stored.block_hashes) == pages and stored.parent_block_hash is None
    assert len(stored.token_ids) == pages * PAGE and stored.block_size == PAGE
    assert stored.medium == "GPU" and stored.lora_id is None
    # The hashes are SGLang's chain over the token ids (hash_str_to_int64 of each SHA-256).
    digest = sglang_block_hash(None, stored.token_ids[:PAGE])
    assert stored.block_hashes[0] == int.from_bytes(digest[:8], "big", signed=True)
    ours = decode_batch(payload)
    assert ours.events == (
        BlockStored(tuple(stored.block_hashes), None, tuple(stored.token_ids), PAGE),
    )

    # The same prompt again: its pages are cached, nothing new is stored.
    assert _chat(emu, text)["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert not sub.poll(300)
    # A different prompt through the 2,048-token pool: stores, and evicts the first one's pages.
    _chat(emu, "Pack my box with five dozen liquor jugs. " * 180)
    kinds: list[Any] = []
    while sub.poll(500):
        _, seq2, payload = sub.recv_multipart()
        assert int.from_bytes(seq2, "big") > int.from_bytes(seq, "big")
        kinds.extend(msgspec.msgpack.decode(payload, type=sglang.KVEventBatch).events)
    removed = [h for e in kinds if isinstance(e, sglang.BlockRemoved) for h in e.block_hashes]
    assert removed, "the pool overflowed: pages were evicted"
    assert set(removed) <= set(stored.block_hashes), "the least recently used prompt's pages"
    assert stored.block_hashes[0] not in removed or set(removed) == set(stored.block_hashes)
    assert any(isinstance(e, sglang.BlockStored) for e in kinds)


# vLLM's classes (vllm/distributed/kv_events.py), their fields in declaration order; vLLM does
# not import without torch, so the test declares them as vLLM does.
class _VLLMEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class VBlockStored(_VLLMEvent, tag="BlockStored"):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class VBlockRemoved(_VLLMEvent, tag="BlockRemoved"):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None


class VAllBlocksCleared(_VLLMEvent, tag="AllBlocksCleared"):
    pass


class VKVEventBatch(msgspec.Struct, omit_defaults=True, gc=False):
    ts: float
    events: list[VBlockStored | VBlockRemoved | VAllBlocksCleared]
    data_parallel_rank: int | None = None


def test_vllm_format(procs: ProcessManager, subs: list[zmq.Socket[bytes]]) -> None:
    emu, sub = _start(procs, subs, "--engine", "vllm", "--max-total-tokens", "1024")
    _settle(emu, sub)
    _chat(emu, "A journey of a thousand miles begins with a single step. " * 20)
    _chat(emu, "Sphinx of black quartz, judge my vow. " * 80)  # evicts through the small pool
    raw: list[dict[str, Any]] = []
    events: list[Any] = []
    while sub.poll(500):
        _, _, payload = sub.recv_multipart()
        raw.append(msgspec.msgpack.decode(payload))
        batch = msgspec.msgpack.decode(payload, type=VKVEventBatch)
        assert batch.data_parallel_rank == 0
        events.extend(batch.events)
        ours = decode_batch(payload).events
        assert [type(e).__name__ for e in ours] == [type(e).__name__[1:] for e in batch.events]
    assert isinstance(raw[0], dict) and set(raw[0]) == {"ts", "events", "data_parallel_rank"}
    first = raw[0]["events"][0]
    assert first["type"] == "BlockStored" and first["lora_name"] is None
    stored = [e for e in events if isinstance(e, VBlockStored)]
    assert stored and all(0 <= h < 2**64 for e in stored for h in e.block_hashes)
    assert any(isinstance(e, VBlockRemoved) for e in events)


def test_bad_config_is_refused(procs: ProcessManager) -> None:
    bad = procs.start(
        [PYTHON, "-m", "app", "emulate", "--port", "{port}", "--kv-events-config", "{nope"],
        name="bad",
        ready_path=None,
    )
    assert bad.popen is not None and bad.popen.wait(30) == 2
    assert "--kv-events-config is not JSON" in bad.logs()
    busy = free_port()
    with zmq.Context.instance().socket(zmq.PUB) as holder:
        holder.bind(f"tcp://127.0.0.1:{busy}")
        config = orjson.dumps(
            {"publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{busy}", "bind": True}
        )
        taken = procs.start(
            [
                PYTHON,
                "-m",
                "app",
                "emulate",
                "--port",
                "{port}",
                "--kv-events-config",
                config.decode(),
            ],
            name="taken",
            ready_path=None,
        )
        assert taken.popen is not None and taken.popen.wait(30) == 1
    assert "KV events" in taken.logs()
