"""The httpx transport the gateway uses for workers: httpcore's HTTP/1.1 connection pool on the
asyncio-native network backend of ``app.upstream.netio`` (plain ``http://`` only: workers sit on
a private network). It is a drop-in ``httpx.AsyncBaseTransport``, so tests still inject their
own transport through ``create_app(settings, transport=...)``."""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator, Iterator
from contextlib import contextmanager

import httpcore
import httpx

from app.upstream.netio import AsyncioBackend

# httpcore's errors as httpx's, most specific first.
_ERRORS: tuple[tuple[type[Exception], type[httpx.HTTPError]], ...] = (
    (httpcore.ConnectTimeout, httpx.ConnectTimeout),
    (httpcore.ReadTimeout, httpx.ReadTimeout),
    (httpcore.WriteTimeout, httpx.WriteTimeout),
    (httpcore.PoolTimeout, httpx.PoolTimeout),
    (httpcore.TimeoutException, httpx.TimeoutException),
    (httpcore.ConnectError, httpx.ConnectError),
    (httpcore.ReadError, httpx.ReadError),
    (httpcore.WriteError, httpx.WriteError),
    (httpcore.NetworkError, httpx.NetworkError),
    (httpcore.UnsupportedProtocol, httpx.UnsupportedProtocol),
    (httpcore.RemoteProtocolError, httpx.RemoteProtocolError),
    (httpcore.LocalProtocolError, httpx.LocalProtocolError),
    (httpcore.ProtocolError, httpx.ProtocolError),
)


@contextmanager
def _mapped() -> Iterator[None]:
    try:
        yield
    except Exception as exc:
        for source, target in _ERRORS:
            if isinstance(exc, source):
                raise target(str(exc)) from exc
        raise


class _Body(httpx.AsyncByteStream):
    def __init__(self, stream: AsyncIterable[bytes]) -> None:
        self._stream = stream

    async def __aiter__(self) -> AsyncIterator[bytes]:
        with _mapped():
            async for part in self._stream:
                yield part

    async def aclose(self) -> None:
        aclose = getattr(self._stream, "aclose", None)
        if aclose is not None:
            await aclose()


class WorkerTransport(httpx.AsyncBaseTransport):
    def __init__(self, *, max_keepalive_connections: int = 1024, keepalive_expiry: float = 60.0):
        self._pool = httpcore.AsyncConnectionPool(
            max_connections=None,
            max_keepalive_connections=max_keepalive_connections,
            keepalive_expiry=keepalive_expiry,
            http1=True,
            http2=False,
            retries=0,
            network_backend=AsyncioBackend(),
        )

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        assert isinstance(request.stream, httpx.AsyncByteStream)
        core_request = httpcore.Request(
            method=request.method,
            url=httpcore.URL(
                scheme=request.url.raw_scheme,
                host=request.url.raw_host,
                port=request.url.port,
                target=request.url.raw_path,
            ),
            headers=request.headers.raw,
            content=request.stream,
            extensions=request.extensions,
        )
        with _mapped():
            response = await self._pool.handle_async_request(core_request)
        assert isinstance(response.stream, AsyncIterable)
        return httpx.Response(
            status_code=response.status,
            headers=response.headers,
            stream=_Body(response.stream),
            extensions=response.extensions,
        )

    async def aclose(self) -> None:
        await self._pool.aclose()
