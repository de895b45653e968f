"""``KvEventSubscriber``: one ZMQ SUB socket per worker, its batches handed to a ``KvEventSink``.

Where each worker publishes (``kv_events`` settings): the worker URL's host, at ``port`` (every
worker started with ``--kv-events-config '{"publisher":"zmq","endpoint":"tcp://*:PORT"}'``, as
the chart does) or at the worker's HTTP port plus ``port_offset`` (several workers on one host).
The worker set follows the pool: every ``resync_s`` new workers are subscribed to and gone ones
dropped (a worker whose URL changed counts as gone and new).

Sequence numbers (``app.workers.kv_events``): the first batch read after subscribing, a batch
whose sequence is not the previous one plus 1 (batches dropped under the publisher's high-water
mark, a restarted worker counting from 0 again), and the first good batch after an undecodable
one are handed over with ``gap=True``. A dropped connection (a socket monitor sees it) makes the
next batch a gap too: ZMQ reconnects by itself, and what a worker published while it was
unreachable is lost, even when its sequence happens to line up. The replay socket some engines
offer is not used: a gap means "start over" for the sink.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from urllib.parse import urlsplit

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from app.workers.config import KvEventsConfig
from app.workers.kv_events import BadBatch, KvEventSink, decode_batch, sequence_number

log = logging.getLogger(__name__)


def endpoint_for(worker_url: str, config: KvEventsConfig) -> str | None:
    """``tcp://host:port`` of a worker's publisher, or None when its URL has no host/port."""
    parts = urlsplit(worker_url)
    host = parts.hostname
    if not host:
        return None
    if config.port_offset is not None:
        base = parts.port or (443 if parts.scheme == "https" else 80)
        port = base + config.port_offset
    else:
        port = config.port
    if not 0 < port <= 65535:
        return None
    if ":" in host:
        host = f"[{host}]"
    return f"tcp://{host}:{port}"


@dataclass
class _Follow:
    endpoint: str
    task: asyncio.Task[None]


class KvEventSubscriber:
    def __init__(
        self,
        config: KvEventsConfig,
        sink: KvEventSink,
        *,
        on_bad_batch: Callable[[str], None] = lambda url: None,
    ) -> None:
        self._config = config
        self._sink = sink
        self._on_bad_batch = on_bad_batch
        self._context: zmq.asyncio.Context | None = None
        self._follows: dict[str, _Follow] = {}
        self._stopping: set[asyncio.Task[None]] = set()

    @property
    def endpoints(self) -> dict[str, str]:
        """Worker URL -> the endpoint it is subscribed at."""
        return {url: f.endpoint for url, f in self._follows.items()}

    def sync(self, worker_urls: Iterable[str]) -> None:
        """Subscribe to every worker in ``worker_urls``, drop the others."""
        wanted: dict[str, str] = {}
        for url in worker_urls:
            endpoint = endpoint_for(url, self._config)
            if endpoint is not None:
                wanted[url] = endpoint
        for url in list(self._follows):
            if wanted.get(url) != self._follows[url].endpoint:
                task = self._follows.pop(url).task
                task.cancel()
                self._stopping.add(task)
                task.add_done_callback(self._stopping.discard)
        for url, endpoint in wanted.items():
            if url not in self._follows:
                task = asyncio.create_task(self._follow(url, endpoint), name=f"kv-events {url}")
                self._follows[url] = _Follow(endpoint, task)

    async def run(self, worker_urls: Callable[[], Iterable[str]]) -> None:
        """Follow the pool until cancelled."""
        try:
            while True:
                self.sync(worker_urls())
                await asyncio.sleep(self._config.resync_s)
        finally:
            await self.close()

    async def close(self) -> None:
        tasks = [f.task for f in self._follows.values()] + list(self._stopping)
        self._follows = {}
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._context is not None:
            self._context.destroy(linger=0)  # every socket closed, none left to wait for
            self._context = None

    async def _follow(self, url: str, endpoint: str) -> None:
        if self._context is None:
            self._context = zmq.asyncio.Context()
        sock = self._context.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 100_000)
        sock.setsockopt(zmq.SUBSCRIBE, self._config.topic.encode())
        # Connection changes: whatever happened while the connection was down is lost.
        monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        poller = zmq.asyncio.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        sock.connect(endpoint)
        state = _Sequence()
        try:
            while True:
                ready = dict(await poller.poll())
                if monitor in ready:
                    parse_monitor_message(await monitor.recv_multipart())
                    state.gap = True
                if sock in ready:
                    self._handle(url, await sock.recv_multipart(), state)
        finally:
            sock.disable_monitor()
            monitor.close(linger=0)
            sock.close(linger=0)

    def _handle(self, url: str, frames: list[bytes], state: _Sequence) -> None:
        try:
            if len(frames) != 3:
                raise BadBatch(f"{len(frames)} frames, not (topic, sequence, payload)")
            seq = sequence_number(frames[1])
            batch = decode_batch(frames[2])
        except BadBatch as exc:
            log.warning("KV events from %s: %s; its cache state is unknown", url, exc)
            self._on_bad_batch(url)
            state.gap = True
            return
        if state.last is not None and seq != state.last + 1:
            state.gap = True
        state.last = seq
        try:
            self._sink.kv_events(url, batch.events, gap=state.gap)
        except Exception:  # a sink's bug must not stop the subscription
            log.exception("KV events sink failed on a batch from %s", url)
            return  # the sink missed this batch: the next one is a gap
        state.gap = False


@dataclass
class _Sequence:
    """One subscription's place in its worker's sequence."""

    last: int | None = None
    # Nothing is known of the worker's cache before the first batch.
    gap: bool = True
