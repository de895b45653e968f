"""A scripted HTTP/1.1 worker: raw asyncio on 127.0.0.1, in a thread of the test process (``with``
starts and stops it), so the gateway in front of it can be a real process and the bytes it gets
are exactly what the subclass writes. Each request on a connection is read whole (its
Content-Length body) and handed to ``handle(path, body, writer)``, in order; a connection the
gateway closes ends quietly."""

from __future__ import annotations

import asyncio
import threading
from typing import Self


class ThreadedWorker:
    def __init__(self) -> None:
        self.port = 0
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> Self:
        self._thread.start()
        assert self._ready.wait(10)
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._loop is not None and self._stop is not None
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = server.sockets[0].getsockname()[1]
        self._ready.set()
        async with server:
            await self._stop.wait()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n")[1:]:
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                body = await reader.readexactly(length)
                await self.handle(head.split(b" ")[1].decode(), body, writer)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def handle(self, path: str, body: bytes, writer: asyncio.StreamWriter) -> None:
        """Answer one request (write the response to ``writer``)."""
        raise NotImplementedError
