"""Pipelined requests (many sent in one write before any answer is read): the server reads at
most ``limits.max_pipelined`` of them ahead on one connection, answers every one in order, and
serves other clients meanwhile (``app.server.uvicorn.protocol``)."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson

from tests.support.gateway import MODEL, FakeWorker, GatewayHarness, wait_for

CAP = 8
LIVEZ = b"GET /livez HTTP/1.1\r\nHost: a\r\n\r\n"
STATUS_200 = b"HTTP/1.1 200 "


def _stream_request() -> bytes:
    body = orjson.dumps(
        {"model": MODEL, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    )
    return (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: a\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    )


def _connection(gw: GatewayHarness) -> Any:
    """The server's protocol for the one client connection open."""
    assert gw.server is not None
    (connection,) = gw.server.server_state.connections
    return connection


async def _read_answers(reader: asyncio.StreamReader, count: int) -> bytes:
    data = b""
    while data.count(STATUS_200) < count:
        chunk = await reader.read(1 << 20)
        assert chunk, f"closed after {data.count(STATUS_200)} answers"
        data += chunk
    return data


async def test_a_connection_is_read_at_most_max_pipelined_requests_ahead() -> None:
    """A stream held by its worker, then 100 probes pipelined behind it in one write: the server
    parses only up to the cap (the rest stays unread, in the socket and one read's buffer), still
    serves other clients, and answers all 101 in order once the stream ends."""
    worker = FakeWorker(hold_after=1)
    async with GatewayHarness([worker], limits={"max_pipelined": CAP}) as gw:
        reader, writer = await asyncio.open_connection("127.0.0.1", int(gw.url.rsplit(":", 1)[1]))
        try:
            writer.write(_stream_request() + LIVEZ * 100)
            await asyncio.wait_for(worker.held.wait(), 5)
            connection = _connection(gw)
            # The stream is answering; the requests read behind it wait in uvicorn's queue.
            await wait_for(lambda: len(connection.pipeline) >= CAP - 1)
            await asyncio.sleep(0.1)  # time to read further, if it were going to
            assert len(connection.pipeline) == CAP - 1  # read: the stream + CAP - 1 probes
            other = await gw.request("GET", "/livez")  # another client is served meanwhile
            assert other.status == 200
            worker.release.set()
            data = await asyncio.wait_for(_read_answers(reader, 101), 20)
            head, _, rest = data.partition(b"\r\n\r\n")
            assert head.startswith(STATUS_200) and b"text/event-stream" in head
            assert rest.index(b"data: [DONE]") < rest.index(STATUS_200)  # the stream came first
            assert data.count(STATUS_200) == 101
        finally:
            writer.close()


async def test_thousands_of_pipelined_requests_are_all_answered_while_others_are_served() -> None:
    async with GatewayHarness([FakeWorker()], limits={"max_pipelined": CAP}) as gw:
        reader, writer = await asyncio.open_connection("127.0.0.1", int(gw.url.rsplit(":", 1)[1]))
        try:
            flood = 4000
            writer.write(LIVEZ * flood)
            answers = asyncio.ensure_future(_read_answers(reader, flood))
            other = await gw.request("GET", "/livez")
            assert other.status == 200
            assert not answers.done()  # answered while the flood is still in progress
            data = await asyncio.wait_for(answers, 60)
            assert data.count(STATUS_200) == flood
        finally:
            writer.close()


async def test_a_body_is_read_whole_whatever_the_pipelining_cap() -> None:
    """A JSON body may hold blank lines (whitespace): cut there, the rest of the body is still
    read at once, even with no request read ahead at all."""
    body = (
        b'{"model": "%s",\r\n\r\n"messages": [{"role": "user", "content": "hi"}],\r\n\r\n'
        b'"stream": false}' % MODEL.encode()
    )
    request = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: a\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    async with GatewayHarness(
        [FakeWorker()], limits={"max_pipelined": 1}, timeouts={"client_body_s": 2}
    ) as gw:
        reader, writer = await asyncio.open_connection("127.0.0.1", int(gw.url.rsplit(":", 1)[1]))
        try:
            writer.write(request + LIVEZ)
            data = await asyncio.wait_for(_read_answers(reader, 2), 10)
            assert data.startswith(STATUS_200) and b'"content":"Hello!"' in data
        finally:
            writer.close()
