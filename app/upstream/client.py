"""The pooled keep-alive HTTP clients a gateway process uses to talk to workers.

The proxied POST (the hot path) goes through ``app.upstream.http1``, a lean HTTP/1.1 client on
asyncio Protocols and httptools; the small control calls (``/health``, ``/v1/loads``,
``/abort_request``) go through httpx. When a transport is injected (``httpx.MockTransport`` in
unit tests) every call goes through httpx and that transport. Either way, ``open`` returns an
``UpstreamResponse`` and errors are raised in httpx's vocabulary below this module and mapped to
``app.errors`` here, at the boundary, so nothing above this module knows httpx's exception tree.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from typing import Any, Protocol
from urllib.parse import urlsplit

import httpx
import orjson

from app.config import Settings
from app.errors import (
    UpstreamConnectError,
    UpstreamError,
    UpstreamStatusError,
    UpstreamStreamBroken,
    UpstreamTimeout,
)
from app.upstream.http1 import Http1Client
from app.upstream.transport import WorkerTransport
from app.workers.worker import Worker

_MAX_ERROR_BODY = 64 * 1024
_MAX_TARGETS = 4096  # cached request heads; workers come and go under discovery


class UpstreamResponse(Protocol):
    """What ``UpstreamClient.open`` returns (an ``httpx.Response`` is one too)."""

    @property
    def status_code(self) -> int: ...

    @property
    def headers(self) -> Mapping[str, str]: ...

    def aiter_raw(self) -> AsyncIterator[bytes]: ...

    async def aread(self) -> bytes: ...

    async def aclose(self) -> None: ...


class UpstreamClient:
    def __init__(self, settings: Settings, transport: httpx.AsyncBaseTransport | None) -> None:
        t = settings.timeouts
        self._abort_s = min(t.connect_s, 5.0)
        # No read timeout on proxied requests: the proxy's supervisor enforces the first-byte
        # and idle deadlines (and aborts on the worker first), without a timer per chunk.
        self._timeout = httpx.Timeout(connect=t.connect_s, read=None, write=t.idle_s, pool=None)
        base_headers = {"accept-encoding": "identity", "content-type": "application/json"}
        if settings.worker_api_key is not None:
            base_headers["authorization"] = f"Bearer {settings.worker_api_key.get_secret_value()}"
        self._base_raw = [(k.encode(), v.encode()) for k, v in base_headers.items()]
        self._timeouts = self._timeout.as_dict()
        self._urls: dict[str, httpx.URL] = {}
        # Per worker URL + path: host, port and the request head up to the per-request headers.
        self._targets: dict[str, tuple[str, int, bytes]] = {}
        self._wire: Http1Client | None = None
        if transport is None:
            self._wire = Http1Client(connect_s=t.connect_s, keepalive_s=t.worker_keepalive_s)
            transport = WorkerTransport(
                max_keepalive_connections=64, keepalive_expiry=t.worker_keepalive_s
            )
        self._transport = transport
        self._client = httpx.AsyncClient(
            transport=transport, timeout=self._timeout, headers=base_headers, trust_env=False
        )

    async def aclose(self) -> None:
        if self._wire is not None:
            await self._wire.aclose()
        await self._client.aclose()

    async def open(
        self,
        worker: Worker,
        path: str,
        body: bytes,
        headers: list[tuple[bytes, bytes]],
    ) -> UpstreamResponse:
        """POST ``body`` and return the streaming response once its headers arrived with 2xx.

        Raises ``UpstreamConnectError`` (never reached the worker / no response: retryable),
        ``UpstreamTimeout`` or ``UpstreamStatusError`` (the worker's own status and message).
        The exact first-byte deadline is the caller's (the proxy's supervisor aborts the attempt
        on its worker before giving up on it).
        """
        response: UpstreamResponse
        if self._wire is not None:
            host, port, prefix = self._target(worker.url + path)
            parts = [prefix, b"content-length: %d\r\n" % len(body)]
            for name, value in headers:
                parts += (name, b": ", value, b"\r\n")
            parts += (b"\r\n", body)
            try:
                response = await self._wire.request(host, port, b"".join(parts))
            except httpx.HTTPError as exc:
                raise map_transport_error(exc, worker, committed=False) from None
        else:
            response = await self._send(worker, path, body, headers)
        if response.status_code >= 300:
            try:
                raw = await self._read_capped(response)
            except httpx.HTTPError:
                raw = b""
            finally:
                await response.aclose()
            raise UpstreamStatusError.from_worker(response.status_code, raw)
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

    async def _send(
        self, worker: Worker, path: str, body: bytes, headers: list[tuple[bytes, bytes]]
    ) -> httpx.Response:
        """The proxied POST through httpx and the injected transport."""
        # Straight to the client's transport: the proxied POST needs none of AsyncClient.send's
        # redirect, auth, cookie or event-hook machinery, and a worker's URL is parsed once.
        url = worker.url + path
        target = self._urls.get(url)
        if target is None:
            if len(self._urls) > 4096:  # workers come and go under discovery
                self._urls.clear()
            target = self._urls[url] = httpx.URL(url)
        request = httpx.Request(
            "POST",
            target,
            content=body,
            headers=self._base_raw + headers,
            extensions={"timeout": self._timeouts},
        )
        try:
            response = await self._transport.handle_async_request(request)
        except httpx.HTTPError as exc:
            raise map_transport_error(exc, worker, committed=False) from None
        response.request = request
        return response

    @staticmethod
    async def _read_capped(response: UpstreamResponse) -> bytes:
        if isinstance(response, httpx.Response) and hasattr(response, "_content"):
            return response.content[:_MAX_ERROR_BODY]  # already read (a transport that buffers)
        parts: list[bytes] = []
        size = 0
        async for part in response.aiter_raw():
            parts.append(part)
            size += len(part)
            if size >= _MAX_ERROR_BODY:
                break
        return b"".join(parts)[:_MAX_ERROR_BODY]

    async def abort(self, worker: Worker, rid: str) -> bool:
        """Best effort ``POST /abort_request``; True when the worker answered 2xx."""
        try:
            status, _ = await self._call(
                worker, "POST", "/abort_request", orjson.dumps({"rid": rid}), self._abort_s
            )
        except UpstreamError:
            return False
        return 200 <= status < 300

    async def get(self, worker: Worker, path: str, timeout: float) -> tuple[int, Any]:  # noqa: ASYNC109
        """GET a small JSON (or empty) document; (status, parsed body or None)."""
        status, content = await self._call(worker, "GET", path, None, timeout)
        data: Any = None
        if content:
            try:
                data = orjson.loads(content)
            except orjson.JSONDecodeError:
                data = None
        return status, data

    async def _call(
        self,
        worker: Worker,
        method: str,
        path: str,
        body: bytes | None,
        timeout: float,  # noqa: ASYNC109
    ) -> tuple[int, bytes]:
        """A small control call (health, loads, models, abort), whole within ``timeout``.
        Raises ``UpstreamTimeout`` or ``UpstreamConnectError``."""
        url = worker.url + path
        if self._wire is None:
            try:
                response = await self._client.request(
                    method, url, content=body, timeout=httpx.Timeout(timeout)
                )
            except httpx.TimeoutException as exc:
                raise UpstreamTimeout(f"{worker.name}{path}: timed out") from exc
            except httpx.HTTPError as exc:
                raise map_transport_error(exc, worker, committed=False) from exc
            return response.status_code, response.content
        host, port, head = self._control_head(url, method)
        if body is not None:
            request = b"%scontent-length: %d\r\n\r\n%s" % (head, len(body), body)
        else:
            request = head + b"\r\n"
        try:
            async with asyncio.timeout(timeout):
                answer = await self._wire.request(host, port, request)
                try:
                    content = await answer.aread()
                finally:
                    await answer.aclose()
        except TimeoutError:
            raise UpstreamTimeout(f"{worker.name}{path}: timed out") from None
        except httpx.HTTPError as exc:
            raise map_transport_error(exc, worker, committed=False) from exc
        return answer.status_code, content

    def _control_head(self, url: str, method: str) -> tuple[str, int, bytes]:
        """Host, port and request head (less the final blank line) of a control call."""
        host, port, head = self._target(url)
        return host, port, method.encode("ascii") + head[4:]  # the cached head is a POST


def map_transport_error(exc: httpx.HTTPError, worker: Worker, *, committed: bool) -> UpstreamError:
    """httpx's errors in the gateway's terms. Before the commit point a dropped connection is
    retryable; after it the stream is broken."""
    name = worker.name
    if isinstance(exc, httpx.TimeoutException) and not isinstance(exc, httpx.ConnectTimeout):
        return UpstreamTimeout(f"worker {name} timed out: {type(exc).__name__}")
    if isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout)):
        return UpstreamConnectError(f"cannot connect to worker {name}")
    if committed:
        return UpstreamStreamBroken(f"worker {name} stream interrupted: {type(exc).__name__}")
    return UpstreamConnectError(f"worker {name} closed the connection: {type(exc).__name__}")


def header_map(headers: Mapping[str, str]) -> list[tuple[bytes, bytes]]:
    return [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]
