"""Two reference relays for ``bench overhead-ab --floor``: what relaying costs on the gateway's own
stack before any of its features, so the gateway's CPU can be read against a floor as well as
against sglang-router.

    python -m loadtest.floor protocol PORT WORKER_URL   # uvloop + httptools, no framework
    python -m loadtest.floor asgi PORT WORKER_URL       # uvicorn + a bare ASGI app

Both forward ``POST`` bodies unchanged to one worker with the gateway's upstream client
(``app.upstream.http1``) and relay its answer: a stream chunk by chunk, anything else whole.
Nothing else: no validation, key, admission, routing, supervision, retry, metrics or logs, and no
error handling beyond dropping the connection. Not a product; a measuring stick.
"""

from __future__ import annotations

import asyncio
import sys
from typing import Any
from urllib.parse import urlsplit

import httptools
import uvicorn
import uvloop

from app.upstream.http1 import Http1Client, Http1Response


class Upstream:
    """The worker and a keep-alive pool to it."""

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or 80
        self._netloc = parts.netloc.encode("ascii")
        self._client: Http1Client | None = None

    async def post(self, target: bytes, body: bytes) -> Http1Response:
        if self._client is None:  # created in the serving loop
            self._client = Http1Client(connect_s=5.0, keepalive_s=60.0)
        head = b"POST %s HTTP/1.1\r\nhost: %s\r\ncontent-type: application/json\r\n" % (
            target,
            self._netloc,
        )
        request = head + b"content-length: %d\r\n\r\n%s" % (len(body), body)
        return await self._client.request(self.host, self.port, request)


def streamed(response: Http1Response) -> bool:
    return "text/event-stream" in response.headers.get("content-type", "")


class Relay(asyncio.Protocol):
    """One client connection, parsed by httptools, each request relayed in a task."""

    upstream: Upstream

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport: asyncio.Transport = transport  # type: ignore[assignment]
        self._parser = httptools.HttpRequestParser(self)
        self._target = b""
        self._body: list[bytes] = []

    def data_received(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError:
            self._transport.close()

    def on_message_begin(self) -> None:
        self._target, self._body = b"", []

    def on_url(self, url: bytes) -> None:
        self._target += url

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        asyncio.get_running_loop().create_task(self._relay(self._target, b"".join(self._body)))

    async def _relay(self, target: bytes, body: bytes) -> None:
        write = self._transport.write
        try:
            response = await self.upstream.post(target, body)
        except Exception:
            self._transport.close()
            return
        try:
            if streamed(response):
                write(
                    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                    b"transfer-encoding: chunked\r\n\r\n"
                )
                async for part in response.aiter_raw():
                    write(b"%x\r\n%b\r\n" % (len(part), part))
                write(b"0\r\n\r\n")
            else:
                data = await response.aread()
                write(
                    b"HTTP/1.1 %d -\r\ncontent-type: application/json\r\n"
                    b"content-length: %d\r\n\r\n%b" % (response.status_code, len(data), data)
                )
        except Exception:
            self._transport.close()
        finally:
            await response.aclose()


def asgi_app(upstream: Upstream) -> Any:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        response = await upstream.post(scope["raw_path"], body)
        try:
            if streamed(response):
                headers = [(b"content-type", b"text/event-stream")]
                await send({"type": "http.response.start", "status": 200, "headers": headers})
                async for part in response.aiter_raw():
                    await send({"type": "http.response.body", "body": part, "more_body": True})
                await send({"type": "http.response.body", "body": b""})
            else:
                data = await response.aread()
                headers = [(b"content-type", b"application/json")]
                start = {"type": "http.response.start", "status": response.status_code}
                await send({**start, "headers": headers})
                await send({"type": "http.response.body", "body": data})
        finally:
            await response.aclose()

    return app


async def serve_protocol(port: int, upstream: Upstream) -> None:
    Relay.upstream = upstream
    server = await asyncio.get_running_loop().create_server(Relay, "127.0.0.1", port)
    await server.serve_forever()


def main(argv: list[str]) -> int:
    kind, port, worker = argv[0], int(argv[1]), argv[2]
    upstream = Upstream(worker)
    if kind == "protocol":
        uvloop.run(serve_protocol(port, upstream))
    elif kind == "asgi":
        uvicorn.run(
            asgi_app(upstream),
            host="127.0.0.1",
            port=port,
            http="httptools",
            loop="uvloop",
            lifespan="off",
            access_log=False,
            log_level="warning",
        )
    else:
        print(f"unknown relay {kind!r}: protocol or asgi", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
