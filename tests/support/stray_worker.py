"""A worker that answers every completion correctly and then, on the same keep-alive connection,
writes a second complete response nobody asked for: raw asyncio on loopback, in a thread of the
test process, so the gateway in front of it is a real process and the bytes are exactly these.

Each completion is answered with the request's ``rid`` as its ``id`` (as SGLang does) and the
text of its last message as the content, whole or streamed as the request asks. ``delays`` (ms)
is cycled over the completions: that long after each answer, the stray follows (0: in the same
write). The stray is a well-framed answer carrying ``STRAY_TEXT`` and the id of an earlier
request, the way a worker that is out of step would send it.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Sequence

import orjson

from tests.support.threaded_worker import ThreadedWorker

MODEL = "moonshotai/Kimi-K2.5"
STRAY_TEXT = "answer-for-EVIL"


def whole(rid: str, text: str) -> bytes:
    body = orjson.dumps(
        {
            "id": rid,
            "object": "chat.completion",
            "model": MODEL,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "finish_reason": "stop",
                }
            ],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
        }
    )
    return b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (
        len(body),
        body,
    )


def streamed(rid: str, text: str) -> bytes:
    def event(delta: dict[str, object], finish: str | None = None) -> bytes:
        choice = {"index": 0, "delta": delta, "finish_reason": finish}
        chunk = {"id": rid, "object": "chat.completion.chunk", "model": MODEL, "choices": [choice]}
        return b"data: " + orjson.dumps(chunk) + b"\n\n"

    usage = {"id": rid, "choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 1}}
    events = [
        event({"role": "assistant", "content": ""}),
        event({"content": text}),
        event({}, "stop"),
        b"data: " + orjson.dumps(usage) + b"\n\n",
        b"data: [DONE]\n\n",
    ]
    head = (
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    )
    return head + b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in events) + b"0\r\n\r\n"


class StrayWorker(ThreadedWorker):
    """See the module doc. ``completions``: how many were answered; ``strays``: sent."""

    def __init__(self, delays: Sequence[float] = (0, 5, 50, 200)) -> None:
        super().__init__()
        self.completions = 0
        self.strays = 0
        self._delays = itertools.cycle(delays)
        self._last_rid = "0" * 32

    async def handle(self, path: str, body: bytes, writer: asyncio.StreamWriter) -> None:
        if path == "/v1/models":
            models = {"object": "list", "data": [{"id": MODEL, "object": "model"}]}
            writer.write(_json(models))
        elif path == "/v1/chat/completions":
            self._complete(orjson.loads(body), writer)
        else:  # /health, /v1/loads, /abort_request
            writer.write(_json({}))

    def _complete(self, request: dict[str, object], writer: asyncio.StreamWriter) -> None:
        rid = str(request["rid"])
        messages = request["messages"]
        assert isinstance(messages, list)
        text = str(messages[-1]["content"])
        render = streamed if request.get("stream") else whole
        self.completions += 1
        stray_rid, self._last_rid = self._last_rid, rid
        stray = render(stray_rid, STRAY_TEXT)
        delay = next(self._delays)
        if delay == 0:
            writer.write(render(rid, text) + stray)
            self.strays += 1
            return
        writer.write(render(rid, text))
        assert self._loop is not None

        def late() -> None:
            if not writer.is_closing():
                writer.write(stray)
                self.strays += 1

        self._loop.call_later(delay / 1000, late)


def _json(doc: object) -> bytes:
    body = orjson.dumps(doc)
    return b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (
        len(body),
        body,
    )
