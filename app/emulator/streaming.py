"""The SSE side of a generation request: SGLang's chunk sequence, plus the fault and gate hooks.

Chat: role chunk (with the first output), then per verify step a reasoning chunk, a content chunk
and/or tool-call chunks (a step whose tokens are all hidden - ``</think>``, tool markers, the stop
token - sends nothing, like SGLang, unless it carries logprobs), then the finish chunk, the usage
chunk when asked, ``[DONE]``. Text completions: one chunk per step, the last one carrying
``finish_reason``. With several choices (``n``, a batch of prompts) their chunks interleave, each
with its ``index`` and its own request id (``app.emulator.choices``).

After every SSE event the writer checks ``die_after_chunks`` and ``inband_error_after_chunks``
(both "at or past k events") and the gate ("exactly k events"), counting the response's events.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

from app.emulator import choices, logprobs, render
from app.emulator.asgi import SSE_HEADERS, ConnectionDrop, Send
from app.emulator.session import Session
from app.emulator.worker import EmulatedWorker


class _Stop(Exception):
    """The stream ended early (in-band error already sent)."""


class StreamWriter:
    """One SSE response for the request's choices (one ``Session`` each, ``index`` order)."""

    def __init__(self, worker: EmulatedWorker, sessions: list[Session], send: Send) -> None:
        self.worker = worker
        self.sessions = sessions
        self._send = send
        self._started = False
        self.sent = 0  # SSE events of this response (faults and the gate count these)
        self.error: str | None = None
        self._vllm = worker.config.vllm  # vLLM's chunk shape (``app.emulator.vllm``)

    async def run(self) -> str | None:
        try:
            await self._check_faults()  # "after 0 events" applies before the first one
            if self.sessions[0].req.kind == "chat":
                await self._chat()
            else:
                await self._completion()
        except _Stop:
            return self.error
        for s in self.sessions:
            s.finish()  # the record is written before the client sees the end
        await self._send({"type": "http.response.body", "body": render.DONE})
        return None

    async def emit(self, data: bytes, session: Session) -> None:
        await self._start()
        await self._send({"type": "http.response.body", "body": data, "more_body": True})
        session.chunks_sent += 1
        self.sent += 1
        await self._check_faults()
        gate = self.worker.gate
        if gate.applies(self.sent):
            held = asyncio.ensure_future(gate.wait())
            aborted = asyncio.ensure_future(session.active.wait_aborted())
            try:
                await asyncio.wait({held, aborted}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                held.cancel()
                aborted.cancel()

    async def _check_faults(self) -> None:
        sent = self.sent
        faults = self.worker.faults
        if faults.die_after_chunks is not None and sent >= faults.die_after_chunks:
            await self._start()
            await die(self.worker, self.sessions)
        inband = faults.inband_error_after_chunks
        if inband is not None and sent >= inband:
            event = render.error_event(
                "The request was aborted by the worker.", "SERVICE_UNAVAILABLE", 503
            )
            await self._start()
            await self._send({"type": "http.response.body", "body": event, "more_body": True})
            self.error = "inband_error"
            for s in self.sessions:
                s.finish(self.error)
            await self._send({"type": "http.response.body", "body": render.DONE})
            raise _Stop

    async def _start(self) -> None:
        if not self._started:
            await self._send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
            self._started = True

    @staticmethod
    def _usage(s: Session) -> dict[str, Any] | None:
        if not s.req.continuous_usage:
            return None
        prompt, completion, reasoning, cached = s.usage_counts()
        if s.req.kind == "completion":
            cached = None  # SGLang's completion chunks carry no cache details
        return render.usage(prompt, completion, reasoning, cached)

    async def _chat(self) -> None:
        """Per choice: the role chunk with its first output, then its steps' chunks (a step's
        logprobs ride on its first reasoning or plain content chunk, else on a chunk of their
        own); after every choice has ended, one finish chunk per choice in the order they
        finished, under the id of the last output (``serving_chat.py`` ``_generate_chat_stream``
        and ``_generate_stream_content``); then the usage chunk."""
        sessions = self.sessions
        req = sessions[0].req
        tools_active = bool(req.tools) and req.tool_choice != "none" and req.json_schema is None
        created = sessions[0].created
        chunks = {
            id(s): render.ChatChunks(
                s.rid, created, req.model, tools_active, s.req.index, vllm=self._vllm
            )
            for s in sessions
        }
        started: set[int] = set()
        finished: list[Session] = []
        last_id = sessions[0].rid
        async for s, step in choices.merged(sessions):
            c = chunks[id(s)]
            last_id = s.rid
            if id(s) not in started:
                started.add(id(s))
                await self.emit(c.role(), s)
            lp = logprobs.chat(step.logprobs) if req.logprobs else None
            if step.reasoning:
                await self.emit(c.reasoning(step.reasoning, self._usage(s), lp), s)
                lp = None
            if step.content:
                await self.emit(c.content(step.content, self._usage(s), lp), s)
                if not tools_active:
                    lp = None
            for delta in step.tool_deltas:
                await self.emit(c.tool(delta, self._usage(s)), s)
            if lp is not None:
                await self.emit(c.logprobs(lp, self._usage(s)), s)
            if s.gen.done:
                finished.append(s)
        for s in sessions:
            if id(s) not in started:
                await self.emit(chunks[id(s)].role(), s)
            if s not in finished:
                finished.append(s)
        for s in finished:
            gen = s.gen
            finish = chunks[id(s)].finish(gen.finish_reason or "abort", gen.matched_stop, last_id)
            await self.emit(finish, s)
        if req.include_usage:
            use = choices.usage(sessions)
            await self.emit(chunks[id(sessions[0])].usage(use, last_id), sessions[-1])

    async def _completion(self) -> None:
        """One chunk per step and choice, the last one carrying ``finish_reason``
        (``serving_completions.py`` ``_generate_completion_stream``); then the usage chunk."""
        sessions = self.sessions
        req = sessions[0].req
        created = sessions[0].created
        chunks = {
            id(s): render.CompletionChunks(s.rid, created, req.model, s.req.index, vllm=self._vllm)
            for s in sessions
        }
        ended: set[int] = set()
        last_id = sessions[0].rid
        async for s, step in choices.merged(sessions):
            gen = s.gen
            finish = gen.finish_reason if gen.done else None
            matched = gen.matched_stop if gen.done else None
            lp = None
            if req.logprobs:
                lp = logprobs.completion(step.logprobs, req.top_logprobs > 0)
            text = chunks[id(s)].text(step.content, finish, matched, self._usage(s), lp)
            await self.emit(text, s)
            last_id = s.rid
            if finish is not None:
                ended.add(id(s))
        for s in sessions:
            if id(s) not in ended:
                reason = s.gen.finish_reason or "abort"
                await self.emit(chunks[id(s)].text("", reason, None, self._usage(s)), s)
        if req.include_usage:
            use = choices.usage(sessions, drop_none=True)
            await self.emit(chunks[id(sessions[0])].usage(use, last_id), sessions[-1])


async def die(worker: EmulatedWorker, sessions: list[Session]) -> None:
    """The ``die_after_chunks`` fault: drop the connection, or end the process (``die_mode``)."""
    if worker.faults.die_mode == "process":
        for session in sessions:
            session.finish("die_after_chunks")
        await asyncio.sleep(0.05)  # let the transport flush what was already sent
        os._exit(1)
    raise ConnectionDrop
