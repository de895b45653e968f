"""``POST /v1/messages/count_tokens`` on the emulated worker, as SGLang serves it: the Messages
body is converted to the chat request it stands for (``messages.py``, as SGLang's own Messages
endpoint converts it), the chat prompt is rendered and its tokens counted (the emulator's
estimate: ``GenRequest.prompt_tokens``, the same figure its chat answers report as
``prompt_tokens``). Answer: ``{"input_tokens": N}``; a body it cannot convert is a 400 in
Anthropic's error shape, as SGLang answers on this route."""

from __future__ import annotations

from typing import Any

import orjson

from app.emulator.asgi import Receive, Scope, Send, read_body, respond_json
from app.emulator.messages import to_chat
from app.emulator.requests import RequestError, parse_chat
from app.emulator.worker import Worker


async def count_tokens(worker: Worker, scope: Scope, receive: Receive, send: Send) -> None:
    try:
        body: Any = orjson.loads(await read_body(receive))
        tokens = parse_chat(to_chat(body)).prompt_tokens
    except (RequestError, ValueError) as exc:
        message = exc.message if isinstance(exc, RequestError) else str(exc)
        error = {"type": "invalid_request_error", "message": message}
        await respond_json(send, 400, {"type": "error", "error": error})
        return
    await respond_json(send, 200, {"input_tokens": tokens})
