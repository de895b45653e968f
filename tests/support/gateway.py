"""In-process gateway for unit tests: ``create_app`` with fake workers behind MockTransport,
driven through raw ASGI so tests see every message (and can disconnect) as it happens.

    async with GatewayHarness([FakeWorker("http://w1:30000")]) as gw:
        result = await gw.post("/v1/chat/completions", {...})
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson

from app.config import Settings
from app.main import create_app
from app.workers.worker import WorkerState

MODEL = "moonshotai/Kimi-K2.5"


def sse(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def chat_chunks(rid: str, texts: Sequence[str], *, usage: bool = True) -> list[bytes]:
    base = {"id": rid, "object": "chat.completion.chunk", "created": 1, "model": MODEL}
    out = [
        sse(
            {
                **base,
                "choices": [
                    {
                        "index": 0,
                        "delta": {"role": "assistant", "content": "", "reasoning_content": None},
                        "finish_reason": None,
                    }
                ],
            }
        )
    ]
    for text in texts:
        delta = {"content": text, "reasoning_content": None}
        out.append(sse({**base, "choices": [{"index": 0, "delta": delta, "finish_reason": None}]}))
    out.append(sse({**base, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}))
    if usage:
        counts = {"prompt_tokens": 7, "completion_tokens": len(texts), "total_tokens": 7}
        out.append(sse({**base, "choices": [], "usage": counts}))
    out.append(b"data: [DONE]\n\n")
    return out


@dataclass
class FakeWorker:
    """A scripted SGLang worker. ``requests`` records every body it was sent."""

    url: str
    healthy: bool = True
    fail_status: int | None = None
    die_after: int | None = None  # chunks, then the connection drops
    hold_after: int | None = None  # chunks, then wait for ``release``
    hang: bool = False  # never answer
    leading_error: int | None = None  # first event is an in-band error with this code
    texts: tuple[str, ...] = ("Hel", "lo", "!")
    requests: list[dict[str, Any]] = field(default_factory=list)
    headers: list[httpx.Headers] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)
    release: asyncio.Event = field(default_factory=asyncio.Event)
    held: asyncio.Event = field(default_factory=asyncio.Event)
    closed: asyncio.Event = field(default_factory=asyncio.Event)

    async def handle(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path == "/health":
            return httpx.Response(200 if self.healthy else 503)
        if path == "/v1/models":
            card = {"id": MODEL, "object": "model", "owned_by": "sglang", "max_model_len": 262144}
            return httpx.Response(200, json={"object": "list", "data": [card]})
        if path == "/abort_request":
            self.aborted.append(orjson.loads(request.content)["rid"])
            return httpx.Response(200)
        if path == "/v1/loads":
            rank = {"dp_rank": 0, "num_running_reqs": 0, "num_waiting_reqs": 0}
            return httpx.Response(200, json={"loads": [rank]})
        body = orjson.loads(await request.aread())
        self.requests.append(body)
        self.headers.append(request.headers)
        if self.hang:
            await asyncio.Event().wait()
        if self.fail_status is not None:
            err = {"object": "error", "message": "The request queue is full.", "type": "x"}
            return httpx.Response(self.fail_status, json={**err, "code": self.fail_status})
        if not body.get("stream"):
            doc = {
                "id": body["rid"],
                "object": "chat.completion",
                "model": MODEL,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hello!"}}],
                "usage": {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10},
            }
            return httpx.Response(200, content=orjson.dumps(doc))
        return httpx.Response(
            200, headers={"content-type": "text/event-stream"}, stream=_Stream(self, body)
        )


class _Stream(httpx.AsyncByteStream):
    def __init__(self, worker: FakeWorker, body: dict[str, Any]) -> None:
        self._worker = worker
        self._body = body

    async def __aiter__(self) -> AsyncIterator[bytes]:
        w = self._worker
        if w.leading_error is not None:
            yield sse({"error": {"message": "overloaded", "code": w.leading_error}})
            yield b"data: [DONE]\n\n"
            return
        chunks = chat_chunks(self._body["rid"], w.texts)
        for i, chunk in enumerate(chunks):
            if w.die_after is not None and i == w.die_after:
                raise httpx.RemoteProtocolError("peer closed connection")
            if w.hold_after is not None and i == w.hold_after:
                w.held.set()
                await w.release.wait()
            yield chunk

    async def aclose(self) -> None:
        self._worker.closed.set()


@dataclass
class Exchange:
    status: int = 0
    headers: dict[str, str] = field(default_factory=dict)
    chunks: list[bytes] = field(default_factory=list)
    complete: bool = False

    @property
    def body(self) -> bytes:
        return b"".join(self.chunks)

    def json(self) -> Any:
        return orjson.loads(self.body)


class GatewayHarness:
    def __init__(self, workers: Sequence[FakeWorker], **settings: Any) -> None:
        self.workers = {w.url: w for w in workers}
        self.settings = Settings(worker_urls=[w.url for w in workers], **settings)

        async def route(request: httpx.Request) -> httpx.Response:
            base = f"{request.url.scheme}://{request.url.host}:{request.url.port}"
            worker = self.workers.get(base)
            if worker is None:
                raise httpx.ConnectError("connection refused", request=request)
            return await worker.handle(request)

        self.app = create_app(self.settings, transport=httpx.MockTransport(route))
        self._stack = contextlib.AsyncExitStack()

    @property
    def gateway(self) -> Any:
        return self.app.state.gateway

    async def __aenter__(self) -> GatewayHarness:
        await self._stack.enter_async_context(self.app.router.lifespan_context(self.app))
        expected = sum(1 for w in self.workers.values() if w.healthy)
        await wait_for(
            lambda: (
                sum(w.state is WorkerState.HEALTHY for w in self.gateway.pool.workers) >= expected
            )
        )
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._stack.aclose()

    async def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        headers: dict[str, str] | None = None,
        raw: bytes | None = None,
        disconnect: asyncio.Event | None = None,
        on_chunk: Callable[[bytes], None] | None = None,
    ) -> Exchange:
        content = raw if raw is not None else (b"" if body is None else orjson.dumps(body))
        hdrs = [(b"content-type", b"application/json")]
        hdrs += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
        scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": method,
            "scheme": "http",
            "path": path,
            "raw_path": path.encode(),
            "query_string": b"",
            "root_path": "",
            "headers": hdrs,
            "client": ("127.0.0.1", 1234),
            "server": ("127.0.0.1", 8000),
            "app": self.app,
        }
        sent_body = False
        gone = disconnect or asyncio.Event()
        ex = Exchange()

        async def receive() -> dict[str, Any]:
            nonlocal sent_body
            if not sent_body:
                sent_body = True
                return {"type": "http.request", "body": content, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                ex.status = message["status"]
                ex.headers = {k.decode(): v.decode() for k, v in message["headers"]}
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    ex.chunks.append(message["body"])
                    if on_chunk is not None:
                        on_chunk(message["body"])
                if not message.get("more_body"):
                    ex.complete = True

        await self.app(scope, receive, send)
        return ex

    async def post(self, path: str, body: Any, **kw: Any) -> Exchange:
        return await self.request("POST", path, body, **kw)


async def wait_for(predicate: Callable[[], object], timeout: float = 5.0) -> None:
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.005)
