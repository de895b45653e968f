"""The gateway's KV event subscriber: both engines' encodings decoded, hostile payloads refused,
sequence gaps flagged; and end to end, a real gateway following a real emulator's cache through
evictions and a flush it did not cause."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Iterator, Sequence
from typing import Any

import httpx
import msgspec
import orjson
import pytest
import zmq

from app.workers.config import KvEventsConfig
from app.workers.kv_events import (
    AllBlocksCleared,
    BadBatch,
    BlockRemoved,
    BlockStored,
    KvEvent,
    decode_batch,
)
from app.workers.kv_subscriber import KvEventSubscriber, endpoint_for
from tests.support.procs import PYTHON, ProcessManager, free_port

pack = msgspec.msgpack.encode
EMULATE = [PYTHON, "-m", "app", "emulate", "--port", "{port}", "--speed", "50"]
EMULATE += ["--page-size", "32", "--max-total-tokens", "4096"]


def test_both_encodings_and_hash_forms() -> None:
    stored = {
        "type": "BlockStored",
        "block_hashes": [-5, 7],
        "parent_block_hash": None,
        "token_ids": [1, 2, 3, 4],
        "block_size": 2,
        "lora_id": None,
        "medium": "GPU",
    }
    sglang = decode_batch(pack([1.5, [stored, {"type": "AllBlocksCleared"}], 0]))
    assert sglang.events == (BlockStored((-5, 7), None, (1, 2, 3, 4), 2), AllBlocksCleared())
    assert sglang.rank == 0
    digest = bytes(range(32))
    vllm = decode_batch(
        pack({"ts": 2.0, "events": [{"type": "BlockRemoved", "block_hashes": [digest, 9],
              "medium": "GPU"}], "data_parallel_rank": 1})
    )  # fmt: skip
    low64 = int.from_bytes(digest, "big") & ((1 << 64) - 1)
    assert vllm.events == (BlockRemoved((low64, 9)),) and vllm.rank == 1
    # Array-like releases: [tag, fields in declaration order...]; the batch an array.
    old = decode_batch(pack([3.0, [["BlockStored", [1], 0, [5, 6], 2, None, None]], None]))
    assert old.events == (BlockStored((1,), 0, (5, 6), 2),)


@pytest.mark.parametrize(
    "payload",
    [
        b"\xc1",  # not msgpack
        pack("hello"),
        pack([1.0]),
        pack([1.0, "events"]),
        pack([True, []]),
        pack([1.0, [{"type": "Bogus"}]]),
        pack([1.0, [{"type": "BlockStored", "block_hashes": "x"}]]),
        pack([1.0, [{"type": "BlockStored", "block_hashes": [1.5], "token_ids": [],
                     "block_size": 1}]]),
        pack([1.0, [{"type": "BlockStored", "block_hashes": [1], "token_ids": ["a"],
                     "block_size": 1}]]),
        pack([1.0, [["BlockRemoved"]]]),
        pack({"ts": 1.0, "events": [], "data_parallel_rank": "0"}),
    ],
)  # fmt: skip
def test_hostile_payloads_are_refused(payload: bytes) -> None:
    with pytest.raises(BadBatch):
        decode_batch(payload)


def test_endpoints_from_worker_urls() -> None:
    fixed = KvEventsConfig(port=5557)
    assert endpoint_for("http://10.0.0.7:30000", fixed) == "tcp://10.0.0.7:5557"
    assert endpoint_for("http://[fd00::1]:30000", fixed) == "tcp://[fd00::1]:5557"
    offset = KvEventsConfig(port_offset=1000)
    assert endpoint_for("http://127.0.0.1:30001", offset) == "tcp://127.0.0.1:31001"
    assert endpoint_for("http://127.0.0.1:65000", offset) is None


class Recorder:
    def __init__(self) -> None:
        self.batches: list[tuple[str, tuple[KvEvent, ...], bool]] = []

    def kv_events(self, worker_url: str, events: Sequence[KvEvent], *, gap: bool) -> None:
        self.batches.append((worker_url, tuple(events), gap))


def _batch(n: int) -> bytes:
    return pack([float(n), [{"type": "BlockRemoved", "block_hashes": [n]}], 0])


@pytest.fixture
def pub() -> Iterator[tuple[zmq.Socket[bytes], int]]:
    sock = zmq.Context.instance().socket(zmq.PUB)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    yield sock, port
    sock.close(linger=0)


async def test_sequence_gaps_restarts_and_bad_batches(pub: tuple[zmq.Socket[bytes], int]) -> None:
    sock, port = pub
    sink = Recorder()
    subscriber = KvEventSubscriber(KvEventsConfig(port=port, topic="kv"), sink)
    url = "http://127.0.0.1:30000"
    subscriber.sync([url])
    assert subscriber.endpoints == {url: f"tcp://127.0.0.1:{port}"}
    try:
        seq = 0
        for _ in range(200):  # until the subscription is up (a SUB misses earlier messages)
            sock.send_multipart((b"kv", seq.to_bytes(8, "big"), _batch(seq)))
            seq += 1
            await asyncio.sleep(0.02)
            if sink.batches:
                break
        assert sink.batches[0][2] is True, "nothing was known before the first batch"

        def send(n: int, payload: bytes | None = None, topic: bytes = b"kv") -> None:
            sock.send_multipart((topic, n.to_bytes(8, "big"), payload or _batch(n)))

        start = len(sink.batches)
        send(seq)  # in order
        send(seq + 2)  # seq + 1 was lost
        send(seq + 3, b"\xc1")  # undecodable
        send(seq + 4)  # after it: unknown again
        send(seq + 5, topic=b"other")  # another topic: not subscribed
        send(seq + 6)
        send(0)  # the worker restarted: its sequence starts over
        send(1)
        deadline = time.monotonic() + 10
        while len(sink.batches) < start + 6 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        got = [(events[0].block_hashes[0], gap) for _, events, gap in sink.batches[start:]]
        assert got == [
            (seq, False),
            (seq + 2, True),
            (seq + 4, True),
            (seq + 6, True),  # seq + 5 on another topic never arrived: a gap all the same
            (0, True),
            (1, False),
        ]
        # The connection drops and comes back (the publisher rebinds): the next batch is a gap
        # even though its sequence follows on.
        sock.close(linger=0)
        sock = zmq.Context.instance().socket(zmq.PUB)
        try:
            for _ in range(100):  # the old socket lets go of the port in ZMQ's I/O thread
                try:
                    sock.bind(f"tcp://127.0.0.1:{port}")
                    break
                except zmq.ZMQError:
                    await asyncio.sleep(0.05)
            start = len(sink.batches)
            for _ in range(250):
                send(2)
                await asyncio.sleep(0.02)
                if len(sink.batches) > start:
                    break
            _, events, gap = sink.batches[start]
            assert events == (BlockRemoved((2,)),) and gap is True
        finally:
            sock.close(linger=0)
        subscriber.sync([])  # the worker left the pool
        assert subscriber.endpoints == {}
    finally:
        await subscriber.close()


def _counter(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(f"dflash_gateway_{name}{{"):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


@pytest.mark.processes
def test_gateway_follows_evictions_it_did_not_cause(procs: ProcessManager) -> None:
    http_port, kv_port = free_port(), free_port()
    config = {"publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{kv_port}", "bind": True}
    emu = procs.start(
        [*EMULATE, "--kv-events-config", orjson.dumps(config).decode()],
        name="emu",
        port=http_port,
    )
    env = {
        "DFLASH_GATEWAY_WORKER_URLS": emu.url,
        "DFLASH_GATEWAY_KV_EVENTS__ENABLED": "true",
        "DFLASH_GATEWAY_KV_EVENTS__PORT_OFFSET": str(kv_port - http_port),
        "DFLASH_GATEWAY_KV_EVENTS__RESYNC_S": "0.2",
        "DFLASH_GATEWAY_HEALTH__INTERVAL_S": "0.2",
    }
    gw = procs.start(
        [PYTHON, "-m", "app", "serve", "--port", "{port}"],
        name="gateway",
        ready_path="/readyz",
        ready_status=200,
        env=env,
        timeout=60,
    )
    worker = re.sub(r"^http://", "", emu.url)

    def metrics() -> str:
        return httpx.get(f"{gw.url}/metrics", timeout=10).text

    def wait(what: str, check: Any) -> str:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            text = metrics()
            if check(text):
                return text
            time.sleep(0.1)
        raise AssertionError(f"timed out waiting for {what}:\n{text}")

    def chat(base: str, content: str) -> None:
        body = {"model": "moonshotai/Kimi-K2.5", "max_tokens": 2,
                "messages": [{"role": "user", "content": content}]}  # fmt: skip
        assert httpx.post(f"{base}/v1/chat/completions", json=body, timeout=30).status_code == 200

    # Through the gateway until its subscription shows the first stored pages.
    for i in range(100):
        chat(gw.url, f"warming up {i} " * 40)
        if _counter(metrics(), "kv_events_blocks_total", kind="stored"):
            break
    text = wait("the first batch", lambda t: _counter(t, "kv_events_gaps_total") >= 1)
    assert _counter(text, "kv_events_blocks_total", worker=worker, kind="removed") == 0
    # Another client, straight to the worker: ~6,000 tokens through its 4,096-token pool.
    for i in range(3):
        chat(emu.url, f"someone else's document {i} " * 300)
    text = wait("evictions", lambda t: _counter(t, "kv_events_blocks_total", kind="removed") > 0)
    removed = _counter(text, "kv_events_tokens_total", worker=worker, kind="removed")
    assert removed > 0 and removed % 32 == 0
    stored = _counter(text, "kv_events_tokens_total", worker=worker, kind="stored")
    assert stored > 4096, "the gateway saw pages it never routed"
    # A flush nobody told the gateway about.
    assert httpx.post(f"{emu.url}/flush_cache", timeout=10).status_code == 200
    wait("the clear", lambda t: _counter(t, "kv_events_clears_total", worker=worker) == 1)
    # The worker restarts: its sequence starts over, which the gateway flags as a gap.
    gaps = _counter(metrics(), "kv_events_gaps_total", worker=worker)
    procs.restart(emu)
    for i in range(100):
        chat(emu.url, f"after the restart {i} " * 40)
        if _counter(metrics(), "kv_events_gaps_total", worker=worker) > gaps:
            break
    else:
        raise AssertionError("the restart was not flagged as a gap")
