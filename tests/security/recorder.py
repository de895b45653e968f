"""A raw asyncio SGLang worker on loopback, in a thread of the test process, that records every
completion body it receives byte for byte (what the gateway really sent) and can hold its answer
until released. It answers a chat or text completion whole, or as a short SSE stream when the body
asks for one (with the usage chunk and ``[DONE]``), and a Messages token count."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import orjson

MODEL = "moonshotai/Kimi-K2.5"


class RecordingWorker:
    def __init__(self) -> None:
        self.bodies: list[bytes] = []
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._hold = False
        self._release: asyncio.Event | None = None
        self.received = threading.Event()  # set when a completion body has been read

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def json(self, index: int = -1) -> dict[str, Any]:
        return orjson.loads(self.bodies[index])  # type: ignore[no-any-return]

    def hold(self) -> None:
        """Answer no completion until ``release``."""
        self._hold = True
        self.received.clear()

    def release(self) -> None:
        self._hold = False
        release = self._release
        if release is not None:
            self._loop.call_soon_threadsafe(release.set)

    async def _serve(self, ready: threading.Event) -> None:
        self._release = asyncio.Event()
        server = await asyncio.start_server(self._connection, "127.0.0.1", 0)
        self.port = server.sockets[0].getsockname()[1]
        ready.set()
        async with server:
            await server.serve_forever()

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                line, *lines = head.decode("latin-1").split("\r\n")
                method, path, _ = line.split(" ", 2)
                headers = {k.lower(): v.strip() for k, _, v in (h.partition(":") for h in lines)}
                body = await reader.readexactly(int(headers.get("content-length", "0")))
                status, answer = await self._answer(method, path.split("?")[0], body)
                kind = b"text/event-stream" if answer.startswith(b"data:") else b"application/json"
                writer.write(
                    b"HTTP/1.1 %d OK\r\ncontent-type: %s\r\n"
                    b"content-length: %d\r\n\r\n%s" % (status, kind, len(answer), answer)
                )
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        except asyncio.CancelledError:
            # The worker is shutting down. Ending quietly matters: Python 3.11's stream server
            # asks a finished handler task for its exception, which raises for a cancelled one
            # and is reported as an unraisable error in whichever test is running then.
            pass
        finally:
            writer.close()

    async def _answer(self, method: str, path: str, body: bytes) -> tuple[int, bytes]:
        if path == "/health":
            return 200, b"{}"
        if path == "/v1/models":
            return 200, orjson.dumps({"object": "list", "data": [{"id": MODEL}]})
        if path == "/v1/loads":
            return 200, b'{"loads":[{"dp_rank":0,"num_running_reqs":0,"num_waiting_reqs":0}]}'
        if method != "POST" or not path.startswith("/v1/"):
            return 200, b"{}"
        self.bodies.append(body)
        self.received.set()
        while self._hold and self._release is not None:
            self._release.clear()
            await self._release.wait()
        sent = orjson.loads(body)
        if path == "/v1/messages/count_tokens":
            return 200, b'{"input_tokens":3}'
        if sent.get("stream") is True:
            return 200, _stream(sent["rid"], path == "/v1/chat/completions")
        doc = {
            "id": sent["rid"],
            "object": "chat.completion",
            "model": MODEL,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "ok"},
                    "finish_reason": "stop",
                }
            ],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
        }
        if path == "/v1/completions":
            doc["object"] = "text_completion"
            doc["choices"] = [{"index": 0, "text": "ok", "finish_reason": "stop"}]
        return 200, orjson.dumps(doc)


def _stream(rid: str, chat: bool) -> bytes:
    """A short completion stream: one token of text, the finish, the usage, ``[DONE]``."""
    kind = "chat.completion.chunk" if chat else "text_completion"

    def choice(text: str | None, finish: str | None) -> dict[str, Any]:
        if not chat:
            return {"index": 0, "text": text or "", "finish_reason": finish}
        delta = {"role": "assistant", "content": text} if text is not None else {}
        return {"index": 0, "delta": delta, "finish_reason": finish}

    usage = {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}
    chunks = [
        {"id": rid, "object": kind, "model": MODEL, "choices": [choice("ok", None)]},
        {"id": rid, "object": kind, "model": MODEL, "choices": [choice(None, "stop")]},
        {"id": rid, "object": kind, "model": MODEL, "choices": [], "usage": usage},
    ]
    return b"".join(b"data: " + orjson.dumps(c) + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"


@contextmanager
def recording_worker() -> Iterator[RecordingWorker]:
    worker = RecordingWorker()
    ready = threading.Event()
    task: list[asyncio.Task[None]] = []

    def run() -> None:
        loop = worker._loop
        asyncio.set_event_loop(loop)
        task.append(loop.create_task(worker._serve(ready)))
        try:
            loop.run_until_complete(task[0])
        except asyncio.CancelledError:
            pass
        finally:  # end every connection before the loop closes
            pending = asyncio.all_tasks(loop)
            for other in pending:
                other.cancel()
            loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            loop.close()

    thread = threading.Thread(target=run, name="recording-worker", daemon=True)
    thread.start()
    ready.wait(10)
    try:
        yield worker
    finally:
        worker.release()
        worker._loop.call_soon_threadsafe(task[0].cancel)
        thread.join(10)
