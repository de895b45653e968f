"""``POST /v1/chat/completions`` and ``POST /v1/completions`` on the emulated worker.

Response headers go out with the first data event, as SGLang's StreamingResponse does (it waits
for the first generated output), so a slow prefill or a long queue shows as time to first byte.
A full waiting queue is answered as SGLang does: non-streaming, HTTP 503 with an ``ErrorResponse``;
streaming, HTTP 200 with one in-band ``data: {"error": {... "code": 503}}`` event and ``[DONE]``.
Several choices (``n``, a batch of prompts) are answered in one body, ``choices`` in index order,
under the first choice's id (``serving_chat.py`` ``_build_chat_response``,
``serving_completions.py`` ``_build_completion_response``).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import orjson

from app.emulator import choices, logprobs, render
from app.emulator.asgi import (
    ConnectionDrop,
    Receive,
    Scope,
    Send,
    header,
    read_body,
    respond_json,
    watch_disconnect,
)
from app.emulator.disagg import TransferFailed
from app.emulator.engine import QueueFull
from app.emulator.generation import check_expansion
from app.emulator.genrequest import GenRequest, RequestError
from app.emulator.grammar import Budget, GrammarError
from app.emulator.logprobs import TokenLogprob
from app.emulator.metrics import EmulatorMetrics
from app.emulator.replay import ReplayBook, handle_replay
from app.emulator.requests import expand, parse_chat, parse_completion
from app.emulator.session import Session
from app.emulator.streaming import StreamWriter, die
from app.emulator.worker import CONTEXT_LEN, EmulatedWorker

log = logging.getLogger(__name__)

_INBAND_MESSAGE = "The request was aborted by the worker."


async def handle_generate(
    worker: EmulatedWorker,
    replay: ReplayBook | None,
    kind: str,
    scope: Scope,
    receive: Receive,
    send: Send,
) -> None:
    try:
        body: Any = orjson.loads(await read_body(receive))
        if not isinstance(body, dict):
            raise RequestError("The request body must be a JSON object.")
        if replay is not None:
            await handle_replay(worker, replay, kind, body, receive, send)
            return
        parse = parse_chat if kind == "chat" else parse_completion
        subs = expand(parse(body))
        for sub in subs:
            if sub.prompt_tokens >= CONTEXT_LEN:
                raise RequestError(
                    f"The input ({sub.prompt_tokens} tokens) is longer than the model's context "
                    f"length ({CONTEXT_LEN} tokens)."
                )
        check_grammars(subs)
    except RequestError as exc:
        body = render.error_body(exc.message, exc.err_type, exc.status, vllm=worker.config.vllm)
        await respond_json(send, exc.status, body)
        return
    except ValueError as exc:  # bad JSON / body
        body = render.error_body(str(exc), "BadRequestError", 400, vllm=worker.config.vllm)
        await respond_json(send, 400, body)
        return
    except (TypeError, AttributeError, KeyError, IndexError) as exc:
        # A body shape the checks above missed: still the request's fault, never a 500 (which
        # a gateway would count against this worker). Logged, to be checked explicitly.
        log.warning("request body not understood", exc_info=True)
        message = f"Invalid request: {type(exc).__name__}: {exc}"
        await respond_json(send, 400, render.error_body(message, "BadRequestError", 400))
        return
    profile = header(scope, b"x-emulator-profile")
    request_id = header(scope, b"x-request-id")
    sessions = [Session(worker, sub, profile, request_id) for sub in subs]

    def on_disconnect() -> None:
        for session in sessions:
            session.active.abort("disconnect")

    watcher = watch_disconnect(receive, on_disconnect)
    error: str | None = None
    try:
        error = await _run(worker, sessions, send)
    except ConnectionDrop:
        error = "die_after_chunks"
        raise
    finally:
        watcher.cancel()
        for session in sessions:
            session.finish(error)


def check_grammars(subs: list[GenRequest]) -> None:
    """The grammar-made text of every distinct prompt, within one ``Budget`` for the request
    (``app.emulator.generation.check_expansion``); a grammar that cannot be read or expands past
    it is a ``RequestError`` (400), like SGLang's grammar compile failures."""
    if not subs[0].constrained and not subs[0].tools:
        return
    first = subs[0]
    budget = Budget("ebnf" if first.ebnf else "regex" if first.regex else "json")
    seen: set[str] = set()
    try:
        for sub in subs:
            if sub.last_user not in seen:
                seen.add(sub.last_user)
                check_expansion(sub, budget)
    except GrammarError as exc:
        raise RequestError(str(exc)) from None
    except RecursionError:
        raise RequestError(
            f"Failed to compile {budget.kind} grammar: it nests too deeply."
        ) from None


async def _run(worker: EmulatedWorker, sessions: list[Session], send: Send) -> str | None:
    """Serve one request; returns the name of the fault that ended it, if any."""
    faults = worker.faults
    first = sessions[0]
    if faults.should_fail(worker.rng):
        status = faults.fail_status or 500
        body = render.error_body("Injected failure.", str(status), status, vllm=worker.config.vllm)
        for session in sessions:
            session.finish("fail_status")
        await respond_json(send, status, body)
        return "fail_status"
    while faults.hang_before_first_byte and not first.aborted:  # noqa: ASYNC110
        await asyncio.sleep(0.02)  # polls: the fault may be cleared at run time
    if faults.first_byte_delay_s > 0 and not first.aborted:
        await asyncio.sleep(faults.first_byte_delay_s)
    if first.aborted == "disconnect":
        return None  # nobody is listening any more
    try:
        await _start(sessions)
    except QueueFull as refused:
        await render.send_queue_full(send, first.req.stream, refused.message)
        return None
    except TransferFailed as failed:
        if failed.stage is not None and isinstance(worker.metrics, EmulatorMetrics):
            worker.metrics.on_transfer_failed(failed.stage)
        for session in sessions:
            if session.room_use.outcome is None and not session.aborted:
                session.room_use.outcome = failed.outcome
                session.room_use.reason = failed.message
        await render.send_abort(send, first.req.stream, failed.message, failed.status)
        return "disaggregation"
    if first.req.stream:
        return await StreamWriter(worker, sessions, send).run()
    return await _non_stream(worker, sessions, send)


async def _start(sessions: list[Session]) -> None:
    """Admission and prefill of every choice; when one finds the queue full, the others are
    aborted (those already admitted leave an aborted record) and ``QueueFull`` is raised."""
    if len(sessions) == 1:
        await sessions[0].start()
        return
    tasks = [asyncio.ensure_future(s.start()) for s in sessions]
    try:
        await asyncio.gather(*tasks)
    except BaseException:
        for session in sessions:
            session.active.abort("abort")
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


async def _collect(session: Session) -> tuple[str, str, str, list[TokenLogprob]]:
    reasoning: list[str] = []
    content: list[str] = []
    arguments: list[str] = []
    lps: list[TokenLogprob] = []
    async for step in session.steps():
        reasoning.append(step.reasoning)
        content.append(step.content)
        arguments.extend(d.arguments for d in step.tool_deltas)
        lps.extend(step.logprobs)
    return "".join(reasoning), "".join(content), "".join(arguments), lps


async def _non_stream(worker: EmulatedWorker, sessions: list[Session], send: Send) -> str | None:
    faults = worker.faults
    if faults.inband_error_after_chunks is not None:
        for session in sessions:
            session.finish("inband_error")
        await respond_json(send, 503, render.error_body(_INBAND_MESSAGE, "503", 503))
        return "inband_error"
    outputs = await asyncio.gather(*(_collect(s) for s in sessions))
    if faults.die_after_chunks is not None:
        await _die(worker, sessions, send)
    first = sessions[0]
    req = first.req
    use = choices.usage(sessions)
    picked: list[dict[str, Any]] = []
    for session, (reasoning, content, arguments, lps) in zip(sessions, outputs, strict=True):
        gen = session.gen
        index = session.req.index
        if req.kind == "completion":
            lp = logprobs.completion(lps, req.top_logprobs > 0) if req.logprobs else None
            picked.append(
                render.completion_choice(index, content, gen.finish_reason, gen.matched_stop, lp)
            )
            continue
        message: dict[str, Any] = {
            "role": "assistant",
            "content": content,
            "reasoning_content": reasoning if reasoning else None,
        }
        if gen.tool_called is not None and gen.finish_reason == "tool_calls":
            call_id = f"functions.{gen.tool_called.name}:{req.history_tool_calls}"
            function = {"name": gen.tool_called.name, "arguments": arguments}
            message["tool_calls"] = [
                {"id": call_id, "index": 0, "type": "function", "function": function}
            ]
        # vLLM has no meta_info (it ignores SGLang's return_meta_info).
        meta = session.meta_info() if req.return_meta_info and not worker.config.vllm else None
        lp = logprobs.chat(lps) if req.logprobs else None
        picked.append(
            render.chat_choice(index, message, gen.finish_reason, gen.matched_stop, meta, lp)
        )
    respond = render.completion_response if req.kind == "completion" else render.chat_response
    out = respond(first.rid, first.created, req.model, picked, use, vllm=worker.config.vllm)
    for session in sessions:
        session.finish()  # the record is written before the client sees the response
    await respond_json(send, 200, out)
    return None


async def _die(worker: EmulatedWorker, sessions: list[Session], send: Send) -> None:
    """Drop the connection after the response headers (or end the process)."""
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await die(worker, sessions)
