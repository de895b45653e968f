"""When a pooled connection may be used again: never when the worker's bytes are waiting on it
unread, never for a request whose answer cannot be checked, and after a stream's last event only
once the response's end followed with nothing more. Real sockets on loopback, both event loops."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

from app.upstream.http1 import Http1Client
from tests.upstream.fakes import SSE_HEAD, Handler, Server, Start, body_of, post

OK = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n#%d"
STRAY = b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nSTRAY"


class ThreadWorker:
    """A worker on a plain socket in a thread: it writes while the test's event loop is blocked,
    so its bytes wait in the kernel's buffer, not yet read by the loop."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.connections = 0
        self.send_stray = threading.Event()
        self.stray_sent = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        served = 0
        self.listener.settimeout(10)
        while served < 2:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self.connections += 1
            with conn:
                while served < 2:
                    try:
                        data = conn.recv(65536)
                    except OSError:  # the client reset it: it had unread bytes
                        break
                    if not data:
                        break
                    served += 1
                    conn.sendall(OK % served)
                    if served == 1:
                        self.send_stray.wait(10)
                        conn.sendall(STRAY)
                        self.stray_sent.set()

    def close(self) -> None:
        self.listener.close()
        self.thread.join(5)


async def test_a_pooled_connection_with_unread_bytes_is_not_reused(client: Http1Client) -> None:
    worker = ThreadWorker()
    try:
        first = await client.request("127.0.0.1", worker.port, post(worker.port))
        assert await body_of(first) == b"#1"
        await first.aclose()
        assert client.idle_connections("127.0.0.1", worker.port) == 1
        # The stray arrives while the event loop is busy: it has not read it when the next
        # request is about to be written on the pooled connection.
        worker.send_stray.set()
        assert worker.stray_sent.wait(5)
        time.sleep(0.05)  # noqa: ASYNC251 - blocking on purpose: the loop must not read it
        second = await client.request("127.0.0.1", worker.port, post(worker.port))
        assert await body_of(second) == b"#2"
        assert worker.connections == 2
    finally:
        worker.close()


async def test_a_fresh_request_never_takes_a_pooled_connection(
    serve: Start, client: Http1Client
) -> None:
    def make(server: Server) -> Handler:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            while True:
                await server.request(reader)
                writer.write(OK % len(server.requests))
                await writer.drain()

        return handle

    server = await serve(make)
    for n in (1, 2):
        response = await client.request("127.0.0.1", server.port, post(server.port), fresh=True)
        assert await body_of(response) == b"#%d" % n
        await response.aclose()
    assert server.connections == 2
    assert client.idle_connections("127.0.0.1", server.port) == 2  # pooled for later, checked use


def last_event_worker(after: bytes) -> tuple[asyncio.Event, asyncio.Event, object]:
    """A stream's [DONE] event; once ``go`` is set, ``after`` (the rest of its response)."""
    go, hung_up = asyncio.Event(), asyncio.Event()

    def make(server: Server) -> Handler:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            while True:
                await server.request(reader)
                done = b"data: [DONE]\n\n"
                writer.write(SSE_HEAD + b"%x\r\n%s\r\n" % (len(done), done))
                await writer.drain()
                await go.wait()
                go.clear()
                writer.write(after)
                await writer.drain()
                if not after.startswith(b"0\r\n"):
                    await reader.read()
                    hung_up.set()
                    return

        return handle

    return go, hung_up, make


async def _until_last_event(client: Http1Client, port: int) -> object:
    response = await client.request("127.0.0.1", port, post(port))
    got: list[bytes] = []

    def sink(data: bytes) -> bool:
        got.append(data)
        if b"[DONE]" in data:
            response.stop()
        return False

    async def never() -> None:
        raise AssertionError("not behind")

    await asyncio.wait_for(response.pump(sink, never), 5)
    assert b"".join(got) == b"data: [DONE]\n\n"
    return response


async def test_after_the_last_event_the_connection_is_pooled_once_its_end_arrives(
    serve: Start, client: Http1Client
) -> None:
    go, _, make = last_event_worker(b"0\r\n\r\n")
    server = await serve(make)  # type: ignore[arg-type]
    response = await _until_last_event(client, server.port)
    strays: list[int] = []
    response.release_at_end(lambda: strays.append(1))  # type: ignore[attr-defined]
    assert client.idle_connections("127.0.0.1", server.port) == 0  # not yet: its end is due
    go.set()
    for _ in range(500):
        if client.idle_connections("127.0.0.1", server.port):
            break
        await asyncio.sleep(0.01)
    assert client.idle_connections("127.0.0.1", server.port) == 1
    again = await _until_last_event(client, server.port)
    assert server.connections == 1 and strays == []
    again.discard()  # type: ignore[attr-defined]


async def test_data_after_the_last_event_closes_the_connection(
    serve: Start, client: Http1Client
) -> None:
    event = b"data: injected\n\n"
    go, hung_up, make = last_event_worker(b"%x\r\n%s\r\n0\r\n\r\n" % (len(event), event))
    server = await serve(make)  # type: ignore[arg-type]
    response = await _until_last_event(client, server.port)
    strays: list[int] = []
    response.release_at_end(lambda: strays.append(1))  # type: ignore[attr-defined]
    go.set()
    await asyncio.wait_for(hung_up.wait(), 5)
    assert strays == [1]
    assert client.idle_connections("127.0.0.1", server.port) == 0
