"""The one pooled keep-alive HTTP client a gateway process uses to talk to workers.

Transport errors are mapped to ``app.errors`` here, at the boundary, so nothing above this module
knows httpx's exception tree. The transport is injectable (``httpx.MockTransport`` in unit tests).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

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
from app.upstream.transport import WorkerTransport
from app.workers.worker import Worker

# Never forwarded to a worker (CONTRACTS.md): credentials, Host/Content-Length (set by the client
# library), hop-by-hop headers (RFC 9110 §7.6.1), and encodings we would have to undo.
_DROP = frozenset(
    {
        "authorization",
        "cookie",
        "host",
        "content-length",
        "content-type",
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "trailers",
        "transfer-encoding",
        "upgrade",
        "accept-encoding",
        "expect",
    }
)
_MAX_ERROR_BODY = 64 * 1024


def forwardable_headers(raw: Iterable[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """The client's end-to-end headers (ASGI raw form) that may go to a worker."""
    headers = list(raw)
    drop = set(_DROP)
    for name, value in headers:
        if name.lower() == b"connection":  # headers it names are hop-by-hop too
            drop.update(v.strip().lower() for v in value.decode("latin-1").split(","))
    return [(n, v) for n, v in headers if n.decode("latin-1").lower() not in drop]


class UpstreamClient:
    def __init__(self, settings: Settings, transport: httpx.AsyncBaseTransport | None) -> None:
        t = settings.timeouts
        self._abort_timeout = httpx.Timeout(min(t.connect_s, 5.0))
        # No read timeout on proxied requests: the proxy's supervisor enforces the first-byte
        # and idle deadlines (and aborts on the worker first), without a timer per chunk.
        self._timeout = httpx.Timeout(connect=t.connect_s, read=None, write=t.idle_s, pool=None)
        base_headers = {"accept-encoding": "identity", "content-type": "application/json"}
        if settings.worker_api_key is not None:
            base_headers["authorization"] = f"Bearer {settings.worker_api_key.get_secret_value()}"
        self._base_raw = [(k.encode(), v.encode()) for k, v in base_headers.items()]
        self._timeouts = self._timeout.as_dict()
        self._urls: dict[str, httpx.URL] = {}
        if transport is None:
            transport = WorkerTransport(max_keepalive_connections=1024, keepalive_expiry=60.0)
        self._transport = transport
        self._client = httpx.AsyncClient(
            transport=transport, timeout=self._timeout, headers=base_headers, trust_env=False
        )

    async def aclose(self) -> None:
        await self._client.aclose()

    async def open(
        self,
        worker: Worker,
        path: str,
        body: bytes,
        headers: list[tuple[bytes, bytes]],
    ) -> httpx.Response:
        """POST ``body`` and return the streaming response once its headers arrived with 2xx.

        Raises ``UpstreamConnectError`` (never reached the worker / no response: retryable),
        ``UpstreamTimeout`` or ``UpstreamStatusError`` (the worker's own status and message).
        The exact first-byte deadline is the caller's (the proxy's supervisor aborts the attempt
        on its worker before giving up on it).
        """
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
        if response.status_code >= 300:
            try:
                raw = await self._read_capped(response)
            except httpx.HTTPError:
                raw = b""
            finally:
                await response.aclose()
            raise UpstreamStatusError.from_worker(response.status_code, raw)
        return response

    @staticmethod
    async def _read_capped(response: httpx.Response) -> bytes:
        if hasattr(response, "_content"):  # already read (e.g. a transport that buffers)
            return response.content[:_MAX_ERROR_BODY]
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
            response = await self._client.post(
                worker.url + "/abort_request",
                content=orjson.dumps({"rid": rid}),
                timeout=self._abort_timeout,
            )
        except httpx.HTTPError:
            return False
        return response.is_success

    async def get(self, worker: Worker, path: str, timeout: float) -> tuple[int, Any]:  # noqa: ASYNC109
        """GET a small JSON (or empty) document; (status, parsed body or None)."""
        try:
            response = await self._client.get(worker.url + path, timeout=timeout)
        except httpx.TimeoutException as exc:
            raise UpstreamTimeout(f"{worker.name}{path}: timed out") from exc
        except httpx.HTTPError as exc:
            raise map_transport_error(exc, worker, committed=False) from exc
        data: Any = None
        if response.content:
            try:
                data = orjson.loads(response.content)
            except orjson.JSONDecodeError:
                data = None
        return response.status_code, data


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
