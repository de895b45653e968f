"""``POST /v1/chat/completions`` and ``POST /v1/completions`` on the emulated worker.

Response headers go out with the first data event, as SGLang's StreamingResponse does (it waits
for the first generated output), so a slow prefill or a long queue shows as time to first byte.
A full waiting queue is answered as SGLang does: non-streaming, HTTP 503 with an ``ErrorResponse``;
streaming, HTTP 200 with one in-band ``data: {"error": {... "code": 503}}`` event and ``[DONE]``.
"""

from __future__ import annotations

import asyncio
from typing import Any

import orjson

from app.emulator import render
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
from app.emulator.engine import QueueFull
from app.emulator.replay import ReplayBook, handle_replay
from app.emulator.requests import RequestError, parse_chat, parse_completion
from app.emulator.session import Session
from app.emulator.streaming import StreamWriter, die
from app.emulator.worker import CONTEXT_LEN, Worker

_INBAND_MESSAGE = "The request was aborted by the worker."


async def handle_generate(
    worker: Worker,
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
        req = parse(body)
        if req.prompt_tokens >= CONTEXT_LEN:
            raise RequestError(
                f"The input ({req.prompt_tokens} tokens) is longer than the model's context "
                f"length ({CONTEXT_LEN} tokens)."
            )
    except RequestError as exc:
        body = render.error_body(exc.message, exc.err_type, exc.status)
        await respond_json(send, exc.status, body)
        return
    except ValueError as exc:  # bad JSON / body
        await respond_json(send, 400, render.error_body(str(exc), "BadRequestError", 400))
        return
    session = Session(
        worker, req, header(scope, b"x-emulator-profile"), header(scope, b"x-request-id")
    )
    watcher = watch_disconnect(receive, lambda: session.active.abort("disconnect"))
    error: str | None = None
    try:
        error = await _run(worker, session, send)
    except ConnectionDrop:
        error = "die_after_chunks"
        raise
    finally:
        watcher.cancel()
        session.finish(error)


async def _run(worker: Worker, session: Session, send: Send) -> str | None:
    """Serve one request; returns the name of the fault that ended it, if any."""
    faults = worker.faults
    if faults.should_fail(worker.rng):
        status = faults.fail_status or 500
        body = render.error_body("Injected failure.", str(status), status)
        session.finish("fail_status")
        await respond_json(send, status, body)
        return "fail_status"
    while faults.hang_before_first_byte and not session.aborted:  # noqa: ASYNC110
        await asyncio.sleep(0.02)  # polls: the fault may be cleared at run time
    if faults.first_byte_delay_s > 0 and not session.aborted:
        await asyncio.sleep(faults.first_byte_delay_s)
    if session.aborted == "disconnect":
        return None  # nobody is listening any more
    try:
        await session.start()
    except QueueFull:
        await render.send_queue_full(send, session.req.stream)
        return None
    if session.req.stream:
        return await StreamWriter(worker, session, send).run()
    return await _non_stream(worker, session, send)


async def _non_stream(worker: Worker, session: Session, send: Send) -> str | None:
    faults = worker.faults
    if faults.inband_error_after_chunks is not None:
        session.finish("inband_error")
        await respond_json(send, 503, render.error_body(_INBAND_MESSAGE, "503", 503))
        return "inband_error"
    reasoning: list[str] = []
    content: list[str] = []
    arguments: list[str] = []
    async for step in session.steps():
        reasoning.append(step.reasoning)
        content.append(step.content)
        arguments.extend(d.arguments for d in step.tool_deltas)
    if faults.die_after_chunks is not None:
        await _die(worker, session, send)
    gen = session.gen
    use = render.usage(*session.usage_counts())
    req = session.req
    if req.kind == "completion":
        out = render.completion_response(
            session.rid,
            session.created,
            req.model,
            "".join(content),
            gen.finish_reason,
            gen.matched_stop,
            use,
        )
        session.finish()  # the record is written before the client sees the response
        await respond_json(send, 200, out)
        return None
    text = "".join(reasoning)
    message: dict[str, Any] = {
        "role": "assistant",
        "content": "".join(content),
        "reasoning_content": text if text else None,
    }
    if gen.tool_called is not None and gen.finish_reason == "tool_calls":
        call_id = f"functions.{gen.tool_called.name}:{req.history_tool_calls}"
        function = {"name": gen.tool_called.name, "arguments": "".join(arguments)}
        message["tool_calls"] = [
            {"id": call_id, "index": 0, "type": "function", "function": function}
        ]
    meta = session.meta_info() if req.return_meta_info else None
    out = render.chat_response(
        session.rid,
        session.created,
        req.model,
        message,
        gen.finish_reason,
        gen.matched_stop,
        use,
        meta,
    )
    session.finish()
    await respond_json(send, 200, out)
    return None


async def _die(worker: Worker, session: Session, send: Send) -> None:
    """Drop the connection after the response headers (or end the process)."""
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await die(worker, session)
