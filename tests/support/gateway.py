"""The gateway in process, on real sockets: fake SGLang workers and the production server stack,
all on 127.0.0.1 in the test's event loop.

- ``FakeWorker`` is a scripted SGLang worker: a raw asyncio server on a free loopback port that
  speaks HTTP/1.1 by hand, so it can misbehave at the byte level (drop the connection after k
  chunks, hold after k chunks until released, never answer, lead with an in-band error, fail with
  a status). It records every completion body and its headers, and every aborted rid.
- ``GatewayHarness`` builds ``create_app(settings)`` with ``worker_urls`` pointing at the fake
  workers and serves it under uvicorn exactly as ``dflash-gateway serve`` configures it
  (``app.server.run.uvicorn_config``: the guarded httptools protocol, which offers the relay's
  direct lane), lifespan included (discovery, health checks, load polling). Requests go over
  loopback with httpx; ``gw.gateway`` is the app's ``Gateway`` (pool, metrics, proxy).

    async with GatewayHarness([FakeWorker()]) as gw:
        ex = await gw.post("/v1/chat/completions", {...})

Test modules that use these run on uvloop, the gateway's event loop: their directory's
conftest.py imports ``pytest_asyncio_loop_factories`` from here.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from http import HTTPStatus
from types import ModuleType
from typing import Any

import httptools
import orjson
import pytest
import uvicorn
import uvloop

from app.config import Settings
from app.main import create_app
from app.proxy.direct import EXTENSION
from app.server.run import guarded, uvicorn_config
from app.sockets import listen

MODEL = "moonshotai/Kimi-K2.5"
HOST = "127.0.0.1"
STALL_BYTES = 64 * 1024  # a worker holding more unsent than this cannot get its stream out
_SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
)


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


@dataclass(eq=False)
class FakeWorker:
    """A scripted SGLang worker on 127.0.0.1 (``url`` and ``name`` once started).

    Completions (POSTs other than ``/abort_request``) are recorded in ``requests`` (the JSON
    body) and ``headers`` (lower-cased names); ``/abort_request`` rids in ``aborted``. A stream
    is chunked SSE, one chunk per event, each handed to the socket before the next; ``closed``
    is set when the gateway hangs up on a completion before its answer ended."""

    healthy: bool = True  # GET /health: 200, else 503 (a worker still loading)
    models: bool = True  # GET /v1/models answers (else 404)
    fail_status: int | None = None  # answer completions with this status and an error body
    fail_marker: bytes | None = None  # ...only those whose body holds these bytes
    die_after: int | None = None  # chunks, then the connection drops
    hold_after: int | None = None  # chunks, then wait for ``release``
    hang: bool = False  # never answer
    leading_error: int | None = None  # first event is an in-band error with this code
    meta_info: dict[str, Any] | None = None  # per choice, when asked (``return_meta_info``)
    usage: bool = True  # answers report their token counts (whole answers: ``usage``)
    texts: tuple[str, ...] = ("Hel", "lo", "!")
    loads: Any = None  # GET /v1/loads: this document (bytes as they are), else one idle rank
    loads_served: int = 0  # GET /v1/loads answered
    server_info: dict[str, Any] | None = None  # GET /server_info: this document, else 404
    server_info_served: int = 0  # GET /server_info answered
    prompt_count: int | None = None  # POST /v1/tokenize: this count (None: 404, not served)
    requests: list[dict[str, Any]] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)
    release: asyncio.Event = field(default_factory=asyncio.Event)
    held: asyncio.Event = field(default_factory=asyncio.Event)
    closed: asyncio.Event = field(default_factory=asyncio.Event)
    stalled: asyncio.Event = field(default_factory=asyncio.Event)  # over STALL_BYTES unsent
    finished: asyncio.Event = field(default_factory=asyncio.Event)  # a stream's last byte went
    sent: int = 0  # stream bytes (events) handed to the socket
    port: int = 0
    _server: asyncio.Server | None = field(default=None, repr=False)
    _conns: dict[asyncio.Task[None], asyncio.StreamWriter] = field(default_factory=dict, repr=False)

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    @property
    def name(self) -> str:
        """The gateway's name for this worker (``host:port``)."""
        return f"{HOST}:{self.port}"

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._connection, HOST, self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        """Stop listening and drop every connection: the port now refuses connections."""
        server, self._server = self._server, None
        if server is None:
            return
        server.close()
        for writer in list(self._conns.values()):
            writer.transport.abort()
        self.release.set()
        tasks = list(self._conns)
        if tasks:
            await asyncio.wait(tasks, timeout=5)
        await server.wait_closed()

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._conns[task] = writer
        try:
            while await self._one(reader, writer):
                pass
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            del self._conns[task]
            writer.close()

    async def _one(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        """Answer one request; False when the connection is to be closed."""
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError:
            return False  # the gateway closed the connection between requests
        line, *lines = head.decode("latin-1").split("\r\n")
        method, target, _ = line.split(" ", 2)
        headers: dict[str, str] = {}
        for item in lines:
            if item:
                name, value = item.split(":", 1)
                headers[name.strip().lower()] = value.strip()
        body = await reader.readexactly(int(headers.get("content-length", "0")))
        path = target.split("?", 1)[0]
        if path == "/health":
            await _answer(writer, 200 if self.healthy else 503, b"")
        elif path == "/v1/models":
            card = {"id": MODEL, "object": "model", "owned_by": "sglang", "max_model_len": 262144}
            doc = {"object": "list", "data": [card]}
            await _answer(writer, 200 if self.models else 404, doc if self.models else b"")
        elif path == "/server_info" and self.server_info is not None:
            await _answer(writer, 200, self.server_info)
            self.server_info_served += 1
        elif path == "/v1/loads":
            rank = {"dp_rank": 0, "num_running_reqs": 0, "num_waiting_reqs": 0}
            await _answer(writer, 200, {"loads": [rank]} if self.loads is None else self.loads)
            self.loads_served += 1
        elif path == "/abort_request":
            self.aborted.append(orjson.loads(body)["rid"])
            await _answer(writer, 200, b"")
        elif method != "POST":
            await _answer(writer, 404, b"")
        elif path == "/v1/tokenize":
            count = self.prompt_count
            await _answer(writer, 404 if count is None else 200, {"count": count})
        else:
            doc = orjson.loads(body)
            self.requests.append(doc)
            self.headers.append(headers)
            fails = self.fail_marker is None or self.fail_marker in body
            return await self._completion(doc, reader, writer, fails)
        return True

    async def _completion(
        self,
        body: dict[str, Any],
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        fails: bool = True,
    ) -> bool:
        """Play the script, watching the connection: a gateway that hangs up (an abort, a client
        gone) ends it (``closed``). ``fails``: ``fail_status`` applies to this request."""
        script = asyncio.ensure_future(self._play(body, writer, fails))
        watch = asyncio.ensure_future(reader.read(1))
        await asyncio.wait({script, watch}, return_when=asyncio.FIRST_COMPLETED)
        if script.done():
            watch.cancel()
            with contextlib.suppress(asyncio.CancelledError, ConnectionError):
                await watch
            return script.result()
        self.closed.set()
        script.cancel()
        with contextlib.suppress(asyncio.CancelledError, ConnectionError):
            await script
        return False

    async def _play(
        self, body: dict[str, Any], writer: asyncio.StreamWriter, fails: bool = True
    ) -> bool:
        if self.hang:
            await asyncio.Event().wait()
        if self.fail_status is not None and fails:
            err = {"object": "error", "message": "The request queue is full.", "type": "x"}
            await _answer(writer, self.fail_status, {**err, "code": self.fail_status})
            return True
        if not body.get("stream"):
            doc: dict[str, Any] = {
                "id": body["rid"],
                "object": "chat.completion",
                "model": MODEL,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hello!"}}],
            }
            if self.usage:
                doc["usage"] = {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}
            if self.meta_info is not None and body.get("return_meta_info"):
                for choice in doc["choices"]:
                    choice["meta_info"] = dict(self.meta_info)
            if self.die_after is not None:  # the answer begun, then the connection drops
                data = orjson.dumps(doc)
                head = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                writer.write(head + b"content-length: %d\r\n\r\n" % len(data) + data[:20])
                await writer.drain()
                writer.transport.close()
                return False
            await _answer(writer, 200, doc)
            return True
        writer.write(_SSE_HEAD)
        if self.leading_error is not None:
            error = {"error": {"message": "overloaded", "code": self.leading_error}}
            chunks = [sse(error), b"data: [DONE]\n\n"]
        else:
            chunks = chat_chunks(body["rid"], self.texts, usage=self.usage)
        transport = writer.transport
        for i, chunk in enumerate(chunks):
            if i == self.die_after:
                await writer.drain()
                transport.close()  # mid-body: the gateway reads an incomplete chunked body
                return False
            if i == self.hold_after:
                await writer.drain()
                self.held.set()
                await self.release.wait()
            writer.write(b"%x\r\n%b\r\n" % (len(chunk), chunk))
            if transport.get_write_buffer_size() > STALL_BYTES:
                self.stalled.set()
            await writer.drain()
            self.sent += len(chunk)
            await asyncio.sleep(0)  # one event per turn of the loop, as a worker streams them
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        self.finished.set()
        return True


async def _answer(writer: asyncio.StreamWriter, status: int, body: bytes | dict[str, Any]) -> None:
    data = body if isinstance(body, bytes) else orjson.dumps(body)
    kind = b"content-type: application/json\r\n" if data else b""
    reason = HTTPStatus(status).phrase.encode()
    head = b"HTTP/1.1 %d %s\r\n%bcontent-length: %d\r\n\r\n" % (status, reason, kind, len(data))
    writer.write(head + data)
    await writer.drain()


@dataclass
class Exchange:
    status: int = 0
    headers: dict[str, str] = field(default_factory=dict)
    chunks: list[bytes] = field(default_factory=list)  # body bytes as each read brought them
    complete: bool = False  # the response ended as framed (not cut, not abandoned)

    @property
    def body(self) -> bytes:
        return b"".join(self.chunks)

    def json(self) -> Any:
        return orjson.loads(self.body)


class Response:
    """One response arriving on a client connection to the gateway: status and headers, then
    the body as each socket read brings it. ``close()`` hangs up (the client gone)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.status = 0
        self.headers: dict[str, str] = {}  # lower-cased names; repeated ones joined by ", "
        self.complete = False
        self._parser = httptools.HttpResponseParser(self)
        self._headers_done = False
        self._body: list[bytes] = []

    # httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        key = name.decode("latin-1").lower()
        old = self.headers.get(key)
        text = value.decode("latin-1")
        self.headers[key] = text if old is None else f"{old}, {text}"

    def on_headers_complete(self) -> None:
        self.status = self._parser.get_status_code()
        self._headers_done = True

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        self.complete = True

    async def _head(self) -> None:
        while not self._headers_done:
            await self._feed()

    async def _feed(self) -> None:
        data = await self.reader.read(256 * 1024)
        if not data:
            raise ConnectionResetError("the gateway closed the connection")
        self._parser.feed_data(data)

    async def read(self) -> bytes | None:
        """The body bytes the next read brought (never empty); None once the body ended.
        Raises ``ConnectionError`` if the connection ended first."""
        while not self._body:
            if self.complete:
                return None
            await self._feed()
        data = b"".join(self._body)
        self._body.clear()
        return data

    @property
    def reusable(self) -> bool:
        return self.complete and self._parser.should_keep_alive()

    def close(self) -> None:
        self.writer.close()


class Client:
    """A lean HTTP/1.1 client for the gateway on loopback, with keep-alive connections."""

    def __init__(self, host: str, port: int) -> None:
        self.host = host
        self.port = port
        self._idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
        self._open: set[asyncio.StreamWriter] = set()

    async def open(
        self,
        method: str,
        path: str,
        content: bytes | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> Response:
        """Send a request (on a kept-alive connection when there is one) and return once the
        response's status and headers arrived."""
        head = [f"{method} {path} HTTP/1.1", f"host: {self.host}:{self.port}"]
        head += [f"{k}: {v}" for k, v in (headers or {}).items()]
        if content is not None:
            head.append(f"content-length: {len(content)}")
        request = ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + (content or b"")
        while self._idle:
            reader, writer = self._idle.pop()
            if not writer.is_closing() and not reader.at_eof():
                break
            writer.close()
        else:
            reader, writer = await asyncio.open_connection(self.host, self.port)
            self._open.add(writer)
        response = Response(reader, writer)
        writer.write(request)
        try:
            await response._head()
        except BaseException:  # no answer (or the client gave up waiting): hang up
            writer.close()
            raise
        return response

    def done(self, response: Response) -> None:
        """The response was read (or abandoned): keep its connection for the next request, or
        close it."""
        if response.reusable and not response.writer.is_closing():
            self._idle.append((response.reader, response.writer))
        else:
            response.close()

    async def aclose(self) -> None:
        self._idle.clear()
        writers, self._open = self._open, set()
        for writer in writers:
            writer.close()
        for writer in writers:
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()


class _LaneSpy:
    """The server's direct lane for one request, passed through, counting the body writes."""

    def __init__(self, lane: Any, harness: GatewayHarness) -> None:
        self._lane = lane
        self._harness = harness

    def write(self, data: bytes) -> bool:
        self._harness.lane_writes += 1
        return bool(self._lane.write(data))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._lane, name)


class GatewayHarness:
    """The fake workers started, the gateway served on 127.0.0.1 and its workers routable."""

    def __init__(
        self,
        workers: Sequence[FakeWorker],
        *,
        clock: Callable[[], float] | None = None,
        rng: random.Random | None = None,
        span_exporter: Any = None,
        prefill: Sequence[FakeWorker] = (),
        decode: Sequence[FakeWorker] = (),
        door_checks: Any = None,
        **settings: Any,
    ) -> None:
        # PD disaggregation (docs/pd.md): ``prefill`` and ``decode`` workers instead of whole
        # ones; each prefill worker's bootstrap port is its ``bootstrap_port`` attribute when
        # it has one, else pd.bootstrap_port.
        self.prefill, self.decode = list(prefill), list(decode)
        self.workers = [*workers, *self.prefill, *self.decode]
        self._settings = settings
        self._factory: dict[str, Any] = {
            "clock": clock,
            "rng": rng,
            "span_exporter": span_exporter,
            "door_checks": door_checks,  # the door's checks (app.door.entrance.checks)
        }
        self.lanes_offered = 0  # requests the server offered the direct lane
        self.lane_writes = 0  # stream chunks the relay wrote through it
        self.server: uvicorn.Server | None = None
        self.client: Client | None = None
        self.url = ""

    @property
    def gateway(self) -> Any:
        return self.app.state.gateway

    async def __aenter__(self) -> GatewayHarness:
        try:
            await self._start()
        except BaseException:
            await self._stop()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._stop()

    async def _start(self) -> None:
        for worker in self.workers:
            await worker.start()
        if self.prefill or self.decode:
            pd = {
                "disaggregation": True,
                "prefill": [
                    f"{w.url} {w.bootstrap_port}" if getattr(w, "bootstrap_port", None) else w.url
                    for w in self.prefill
                ],
                "decode": [w.url for w in self.decode],
                **self._settings.pop("pd", {}),
            }
            self.settings = Settings(pd=pd, **self._settings)
        else:
            self.settings = Settings(worker_urls=[w.url for w in self.workers], **self._settings)
        factory = {k: v for k, v in self._factory.items() if v is not None}
        self.app = create_app(self.settings, **factory)
        app = self.app

        async def spy(scope: Any, receive: Any, send: Any) -> None:
            lane = scope.get("extensions", {}).get(EXTENSION)
            if lane is not None:
                self.lanes_offered += 1
                scope["extensions"][EXTENSION] = _LaneSpy(lane, self)
            await app(scope, receive, send)

        # What uvicorn.Server.serve does, less the signal handlers and its 0.1 s polling.
        server = self.server = uvicorn.Server(
            uvicorn_config(spy, guarded(self.gateway, self.settings), self.settings)
        )
        server.config.load()
        server.lifespan = server.config.lifespan_class(server.config)
        self._sock = listen(HOST, 0)
        await server.startup(sockets=[self._sock])
        self.url = f"http://{HOST}:{self._sock.getsockname()[1]}"
        self.client = Client(HOST, self._sock.getsockname()[1])
        listed = {id(w): "prefill" for w in self.prefill} | {id(w): "decode" for w in self.decode}

        def admissible(w: FakeWorker) -> bool:
            """Healthy, serving, and (PD) running the role it is listed for."""
            mode = (w.server_info or {}).get("disaggregation_mode", listed.get(id(w)))
            return w.healthy and w.models and mode == listed.get(id(w), mode)

        expected = sum(1 for w in self.workers if admissible(w))
        pool = self.gateway.pool
        await wait_for(lambda: len(pool.available(MODEL)) >= expected)

    async def _stop(self) -> None:
        if self.client is not None:
            await self.client.aclose()
        for worker in self.workers:
            worker.release.set()
        server = self.server
        if server is not None and server.started:
            for listener in server.servers:
                listener.close()
            self._sock.close()
            state = server.server_state
            for connection in list(state.connections):
                connection.shutdown()
            try:
                await wait_for(lambda: not state.connections and not state.tasks, timeout=10)
            finally:
                for task in state.tasks:
                    task.cancel()
                await server.lifespan.shutdown()
                for listener in server.servers:
                    await listener.wait_closed()
        for worker in self.workers:
            await worker.stop()

    async def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        headers: Mapping[str, str] | None = None,
        raw: bytes | None = None,
        disconnect: asyncio.Event | None = None,
        on_chunk: Callable[[bytes], None] | None = None,
    ) -> Exchange:
        """One request over a kept-alive connection; the body as it arrives. When
        ``disconnect`` is set first, the connection is closed there and then (the client gone)."""
        content = raw if raw is not None else (None if body is None else orjson.dumps(body))
        hdrs = {"content-type": "application/json"} if content is not None else {}
        hdrs.update({k.lower(): v for k, v in (headers or {}).items()})
        ex = Exchange()
        client = self.client
        assert client is not None
        response: Response | None = None

        async def exchange() -> None:
            nonlocal response
            response = await client.open(method, path, content, hdrs)
            ex.status, ex.headers = response.status, response.headers
            while (chunk := await response.read()) is not None:
                ex.chunks.append(chunk)
                if on_chunk is not None:
                    on_chunk(chunk)
            ex.complete = True

        try:
            if disconnect is None:
                with contextlib.suppress(ConnectionError):
                    await exchange()
                return ex
            talking = asyncio.ensure_future(exchange())
            gone = asyncio.ensure_future(disconnect.wait())
            await asyncio.wait({talking, gone}, return_when=asyncio.FIRST_COMPLETED)
            for task in (talking, gone):
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, ConnectionError):
                    await task
            return ex
        finally:
            if response is not None:
                client.done(response)  # an unfinished exchange's connection is closed here

    async def post(self, path: str, body: Any, **kw: Any) -> Exchange:
        return await self.request("POST", path, body, **kw)


async def wait_for(predicate: Callable[[], object], timeout: float = 5.0) -> None:
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.005)


def _uses_this_module(module: ModuleType | None) -> bool:
    return module is not None and any(
        getattr(value, "__module__", None) == __name__ for value in vars(module).values()
    )


def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> Mapping[str, Callable[[], asyncio.AbstractEventLoop]]:
    """Tests of modules that use the harness or fake workers run on uvloop, the gateway's event
    loop; the other tests of the directory on asyncio's default loop."""
    if _uses_this_module(getattr(item, "module", None)):
        return {"uvloop": uvloop.new_event_loop}
    return {"asyncio": asyncio.new_event_loop}
