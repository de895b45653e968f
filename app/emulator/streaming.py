"""The SSE side of a generation request: SGLang's chunk sequence, plus the fault and gate hooks.

Chat: role chunk (with the first output), then per verify step a reasoning chunk, a content chunk
and/or tool-call chunks (a step whose tokens are all hidden - ``</think>``, tool markers, the stop
token - sends nothing, like SGLang), then the finish chunk, the usage chunk when asked, ``[DONE]``.
Text completions: one chunk per step, the last one carrying ``finish_reason``.

After every SSE event the writer checks ``die_after_chunks`` and ``inband_error_after_chunks``
(both "at or past k events") and the gate ("exactly k events").
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

from app.emulator import render
from app.emulator.asgi import SSE_HEADERS, ConnectionDrop, Send
from app.emulator.session import Session
from app.emulator.worker import Worker


class _Stop(Exception):
    """The stream ended early (in-band error already sent)."""


class StreamWriter:
    def __init__(self, worker: Worker, session: Session, send: Send) -> None:
        self.worker = worker
        self.session = session
        self._send = send
        self._started = False
        self.error: str | None = None

    async def run(self) -> str | None:
        try:
            await self._check_faults()  # "after 0 events" applies before the first one
            if self.session.req.kind == "chat":
                await self._chat()
            else:
                await self._completion()
        except _Stop:
            return self.error
        self.session.finish()  # the record is written before the client sees the end
        await self._send({"type": "http.response.body", "body": render.DONE})
        return None

    async def emit(self, data: bytes) -> None:
        await self._start()
        await self._send({"type": "http.response.body", "body": data, "more_body": True})
        s = self.session
        s.chunks_sent += 1
        await self._check_faults()
        sent = s.chunks_sent
        gate = self.worker.gate
        if gate.applies(sent):
            held = asyncio.ensure_future(gate.wait())
            aborted = asyncio.ensure_future(s.active.wait_aborted())
            try:
                await asyncio.wait({held, aborted}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                held.cancel()
                aborted.cancel()

    async def _check_faults(self) -> None:
        s = self.session
        sent = s.chunks_sent
        faults = self.worker.faults
        if faults.die_after_chunks is not None and sent >= faults.die_after_chunks:
            await self._start()
            await die(self.worker, s)
        inband = faults.inband_error_after_chunks
        if inband is not None and sent >= inband:
            event = render.error_event(
                "The request was aborted by the worker.", "SERVICE_UNAVAILABLE", 503
            )
            await self._start()
            await self._send({"type": "http.response.body", "body": event, "more_body": True})
            self.error = "inband_error"
            s.finish(self.error)
            await self._send({"type": "http.response.body", "body": render.DONE})
            raise _Stop

    async def _start(self) -> None:
        if not self._started:
            await self._send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
            self._started = True

    def _usage(self) -> dict[str, Any] | None:
        s = self.session
        if not s.req.continuous_usage:
            return None
        prompt, completion, reasoning, cached = s.usage_counts()
        if s.req.kind == "completion":
            cached = None  # SGLang's completion chunks carry no cache details
        return render.usage(prompt, completion, reasoning, cached)

    async def _chat(self) -> None:
        s = self.session
        req = s.req
        tools_active = bool(req.tools) and req.tool_choice != "none"
        chunks = render.ChatChunks(s.rid, s.created, req.model, tools_active)
        first = True
        async for step in s.steps():
            if first:
                await self.emit(chunks.role())
                first = False
            if step.reasoning:
                await self.emit(chunks.reasoning(step.reasoning, self._usage()))
            if step.content:
                await self.emit(chunks.content(step.content, self._usage()))
            for delta in step.tool_deltas:
                await self.emit(chunks.tool(delta, self._usage()))
        if first:
            await self.emit(chunks.role())
        gen = s.gen
        await self.emit(chunks.finish(gen.finish_reason or "abort", gen.matched_stop))
        if req.include_usage:
            await self.emit(chunks.usage(render.usage(*s.usage_counts())))

    async def _completion(self) -> None:
        s = self.session
        req = s.req
        chunks = render.CompletionChunks(s.rid, s.created, req.model)
        gen = s.gen
        last_had_finish = False
        async for step in s.steps():
            finish = gen.finish_reason if gen.done else None
            matched = gen.matched_stop if gen.done else None
            await self.emit(chunks.text(step.content, finish, matched, self._usage()))
            last_had_finish = finish is not None
        if not last_had_finish:
            await self.emit(chunks.text("", gen.finish_reason or "abort", None, self._usage()))
        if req.include_usage:
            use = render.usage(*s.usage_counts(), drop_none=True)
            await self.emit(chunks.usage(use))


async def die(worker: Worker, session: Session) -> None:
    """The ``die_after_chunks`` fault: drop the connection, or end the process (``die_mode``)."""
    if worker.faults.die_mode == "process":
        session.finish("die_after_chunks")
        await asyncio.sleep(0.05)  # let the transport flush what was already sent
        os._exit(1)
    raise ConnectionDrop
