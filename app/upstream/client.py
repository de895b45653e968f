"""The gateway's calls to workers, over the pooled keep-alive HTTP/1.1 client of
``app.upstream.http1``: the proxied POST (the hot path) and the small control calls
(``/health``, ``/v1/loads``, ``/v1/models``, ``/abort_request``, vLLM's ``/metrics``).

This module is the boundary: below it errors are ``app.upstream.errors``, above it they are
``app.errors`` (``map_transport_error``), and a worker's error status becomes an
``UpstreamStatusError`` carrying the worker's own message.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeAlias
from urllib.parse import urlsplit

import orjson

from app.config import Settings
from app.errors import (
    UpstreamBadResponse,
    UpstreamConnectError,
    UpstreamError,
    UpstreamStatusError,
    UpstreamStreamBroken,
    UpstreamTimeout,
)
from app.upstream.errors import (
    ConnectFailed,
    MalformedResponse,
    ReadTimeout,
    TransportError,
)
from app.upstream.http1 import Http1Client, Http1Response
from app.upstream.usage import reported_count


class WorkerAddress(Protocol):
    """What the client needs of a worker (``app.workers.worker.Worker`` is one): where it
    listens, and the name its errors use."""

    @property
    def url(self) -> str: ...

    @property
    def name(self) -> str: ...


# What ``UpstreamClient.open`` returns.
UpstreamResponse: TypeAlias = Http1Response

_JOIN_MAX = 64 * 1024  # bodies up to this size are sent as one bytes object
_MAX_ERROR_BODY = 64 * 1024  # of a worker's error response, read for its message
_MAX_CONTROL_BODY = 1024 * 1024  # of a control call's answer (/v1/models, /v1/loads...)
_MAX_TARGETS = 4096  # cached request heads; workers come and go under discovery


class UpstreamClient:
    def __init__(self, settings: Settings) -> None:
        t = settings.timeouts
        self._abort_s = min(t.connect_s, 5.0)
        base = [(b"accept-encoding", b"identity"), (b"content-type", b"application/json")]
        if settings.worker_api_key is not None:
            key = settings.worker_api_key.get_secret_value()
            base.append((b"authorization", b"Bearer " + key.encode()))
        self._base_raw = base
        # Per worker URL + path: host, port and the request head up to the per-request headers.
        self._targets: dict[str, tuple[str, int, bytes]] = {}
        # No read timeout on proxied requests: the proxy's supervisor enforces the first-byte
        # and idle deadlines (and aborts on the worker first), without a timer per chunk.
        self._wire = Http1Client(connect_s=t.connect_s, keepalive_s=t.worker_keepalive_s)

    async def aclose(self) -> None:
        await self._wire.aclose()

    async def open(
        self,
        worker: WorkerAddress,
        path: str,
        body: bytes | Sequence[bytes | memoryview],
        headers: list[tuple[bytes, bytes]],
        sent: Callable[[], None] | None = None,
        fresh: bool = False,
    ) -> UpstreamResponse:
        """POST ``body`` (its pieces, in order) and return the streaming response once its
        headers arrived with 2xx. A large body is written piece by piece, never joined.
        ``sent()`` is called once the request is handed to its connection (from then on the
        worker may be running it). ``fresh``: on a new connection (the caller cannot check that
        the answer is the one to this request).

        Raises ``UpstreamConnectError`` (never reached the worker / no response: retryable),
        ``UpstreamBadResponse`` (not an HTTP/1.1 response the gateway accepts),
        ``UpstreamTimeout`` or ``UpstreamStatusError`` (the worker's own status and message).
        The exact first-byte deadline is the caller's (the proxy's supervisor aborts the attempt
        on its worker before giving up on it).
        """
        host, port, prefix = self._target(worker.url + path)
        if isinstance(body, bytes):
            body = (body,)
        size = sum(map(len, body))
        parts: list[bytes | memoryview] = [prefix, b"content-length: %d\r\n" % size]
        for name, value in headers:
            parts += (name, b": ", value, b"\r\n")
        parts.append(b"\r\n")
        parts += body
        # One bytes object for a usual request (one write); a large body stays in pieces.
        data = b"".join(parts) if size <= _JOIN_MAX else parts
        try:
            response = await self._wire.request(host, port, data, sent=sent, fresh=fresh)
        except TransportError as exc:
            raise map_transport_error(exc, worker, committed=False) from None
        status = response.status_code
        if status >= 300:
            try:
                raw = await _read_capped(response)
            except TransportError:
                raw = b""
            finally:
                await response.aclose()
            if not 400 <= status < 600:  # a redirect, or no HTTP status at all
                raise UpstreamBadResponse(f"worker {worker.name} answered HTTP {status}")
            raise UpstreamStatusError.from_worker(status, raw)
        return response

    def _target(self, url: str) -> tuple[str, int, bytes]:
        target = self._targets.get(url)
        if target is None:
            parts = urlsplit(url)
            if parts.scheme != "http" or not parts.hostname:
                raise UpstreamConnectError(f"unsupported worker URL {url!r} (plain http only)")
            path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
            head = f"POST {path} HTTP/1.1\r\nhost: {parts.netloc}\r\n".encode("latin-1")
            head += b"".join(k + b": " + v + b"\r\n" for k, v in self._base_raw)
            if len(self._targets) > _MAX_TARGETS:
                self._targets.clear()
            target = self._targets[url] = (parts.hostname, parts.port or 80, head)
        return target

    async def abort(self, worker: WorkerAddress, rid: str) -> bool:
        """Best effort ``POST /abort_request``; True when the worker answered 2xx."""
        try:
            status, _ = await self._call(
                worker, "POST", "/abort_request", orjson.dumps({"rid": rid}), self._abort_s
            )
        except UpstreamError:
            return False
        return 200 <= status < 300

    async def prompt_tokens(self, worker: WorkerAddress, body: bytes) -> int | None:
        """The prompt tokens of the chat request ``body`` as ``worker`` counts them
        (SGLang's ``POST /v1/tokenize`` with its fields: ``count``); None when it cannot say."""
        try:
            status, content = await self._call(worker, "POST", "/v1/tokenize", body, self._abort_s)
            count = orjson.loads(content).get("count") if 200 <= status < 300 else None
        except (UpstreamError, orjson.JSONDecodeError, AttributeError):
            return None
        return reported_count(count)

    async def get(self, worker: WorkerAddress, path: str, timeout: float) -> tuple[int, Any]:  # noqa: ASYNC109
        """GET a small JSON (or empty) document; (status, parsed body or None)."""
        status, content = await self._call(worker, "GET", path, None, timeout)
        data: Any = None
        if content:
            try:
                data = orjson.loads(content)
            except orjson.JSONDecodeError:
                data = None
        return status, data

    async def fetch(
        self,
        worker: WorkerAddress,
        path: str,
        timeout: float,  # noqa: ASYNC109
        limit: int = _MAX_CONTROL_BODY,
    ) -> tuple[int, bytes]:
        """GET a small document as bytes (a Prometheus exposition), at most ``limit`` bytes."""
        return await self._call(worker, "GET", path, None, timeout, limit)

    async def _call(
        self,
        worker: WorkerAddress,
        method: str,
        path: str,
        body: bytes | None,
        timeout: float,  # noqa: ASYNC109
        limit: int = _MAX_CONTROL_BODY,
    ) -> tuple[int, bytes]:
        """A small control call (health, loads, models, abort), whole within ``timeout``, its
        answer at most ``_MAX_CONTROL_BODY`` bytes. Raises an ``UpstreamError``.

        Its answer carries no request id to check, so it goes on a new connection, never a
        pooled one: no late stray response can be waiting there. (Its connection is pooled
        afterwards: proxied requests check their answers' ids.) A few calls per worker and
        ``health.loads_interval_s``: the connects cost nothing that shows."""
        host, port, head = self._control_head(worker.url + path, method)
        if body is not None:
            request = b"%scontent-length: %d\r\n\r\n%s" % (head, len(body), body)
        else:
            request = head + b"\r\n"
        try:
            async with asyncio.timeout(timeout):
                answer = await self._wire.request(host, port, request, fresh=True)
                try:
                    content = await answer.aread(limit)
                finally:
                    await answer.aclose()
        except TimeoutError:
            raise UpstreamTimeout(f"{worker.name}{path}: timed out") from None
        except TransportError as exc:
            raise map_transport_error(exc, worker, committed=False) from exc
        return answer.status_code, content

    def _control_head(self, url: str, method: str) -> tuple[str, int, bytes]:
        """Host, port and request head (less the final blank line) of a control call."""
        host, port, head = self._target(url)
        return host, port, method.encode("ascii") + head[4:]  # the cached head is a POST


async def _read_capped(response: UpstreamResponse) -> bytes:
    """At most ``_MAX_ERROR_BODY`` bytes of an error response's body."""
    parts: list[bytes] = []
    size = 0
    async for part in response.aiter_raw():
        parts.append(part)
        size += len(part)
        if size >= _MAX_ERROR_BODY:
            break
    return b"".join(parts)[:_MAX_ERROR_BODY]


def map_transport_error(
    exc: TransportError, worker: WorkerAddress, *, committed: bool
) -> UpstreamError:
    """``app.upstream.errors`` in the gateway's terms. Before the commit point a dropped
    connection is retryable; after it the stream is broken."""
    name = worker.name
    kind = type(exc).__name__
    if isinstance(exc, ReadTimeout):
        return UpstreamTimeout(f"worker {name} timed out: {exc}")
    if isinstance(exc, ConnectFailed):
        return UpstreamConnectError(f"cannot connect to worker {name}: {exc}")
    if committed:
        return UpstreamStreamBroken(f"worker {name} stream interrupted: {kind}: {exc}")
    if isinstance(exc, MalformedResponse):
        return UpstreamBadResponse(f"worker {name} sent an invalid response: {exc}")
    return UpstreamConnectError(f"worker {name} closed the connection: {exc}")
