"""``POST /v1/tokenize`` and ``POST /v1/messages/count_tokens`` on the emulated worker.

``/v1/tokenize`` (SGLang's ``serving_tokenize.py``): ``prompt`` (a string) or ``messages`` (a chat
request's fields, rendered as for a chat completion, ``continue_final_message`` included) ->
``{"tokens": [...], "count": N, "max_model_len": ...}``, ``count`` being the ``prompt_tokens`` a
chat request with those fields reports (a continued prefix's tokens included, counted as the
generation that would continue it counts them: ``app.emulator.generation``). The emulator has no
vocabulary: ``tokens`` are placeholders (0 .. N-1); the count is what it answers for.

``/v1/messages/count_tokens``, as SGLang serves it: the Messages body is converted to the chat
request it stands for (``messages.py``, as SGLang's own Messages endpoint converts it), the chat
prompt is rendered and its tokens counted (the emulator's estimate: ``GenRequest.prompt_tokens``,
the same figure its chat answers report as ``prompt_tokens``). Answer: ``{"input_tokens": N}``;
a body it cannot convert is a 400 in Anthropic's error shape, as SGLang answers on this route."""

from __future__ import annotations

from typing import Any

import orjson

from app.emulator.asgi import Receive, Scope, Send, read_body, respond_json
from app.emulator.generation import Generation
from app.emulator.genrequest import CHARS_PER_TOKEN, RequestError
from app.emulator.messages import to_chat
from app.emulator.requests import parse_chat
from app.emulator.session import pick_profile, request_rng
from app.emulator.worker import CONTEXT_LEN, EmulatedWorker


async def count_tokens(worker: EmulatedWorker, scope: Scope, receive: Receive, send: Send) -> None:
    try:
        body: Any = orjson.loads(await read_body(receive))
        tokens = parse_chat(to_chat(body)).prompt_tokens
    except (RequestError, ValueError) as exc:
        message = exc.message if isinstance(exc, RequestError) else str(exc)
        error = {"type": "invalid_request_error", "message": message}
        await respond_json(send, 400, {"type": "error", "error": error})
        return
    await respond_json(send, 200, {"input_tokens": tokens})


async def tokenize(worker: EmulatedWorker, scope: Scope, receive: Receive, send: Send) -> None:
    try:
        body: Any = orjson.loads(await read_body(receive))
        if not isinstance(body, dict):
            raise RequestError("The request body must be a JSON object.")
        if (body.get("prompt") is None) == (body.get("messages") is None):
            raise RequestError("Exactly one of 'prompt' or 'messages' must be provided.")
        prompt = body.get("prompt")
        if prompt is not None:
            if not isinstance(prompt, str):
                raise RequestError("This emulated worker tokenizes one prompt string.")
            count = -(-len(prompt) // CHARS_PER_TOKEN)
        else:
            req = parse_chat(body)
            count = req.prompt_tokens
            if req.continued:  # the prefix as the generation continuing it counts it
                profile = pick_profile(None, worker.config.profile, req)
                model = worker.models.get(profile, req.temperature)
                count += Generation(req, profile, model, request_rng(req, worker.rng)).prefix_tokens
    except (RequestError, ValueError) as exc:
        message = exc.message if isinstance(exc, RequestError) else str(exc)
        await respond_json(send, 400, {"object": "error", "message": message, "code": 400})
        return
    await respond_json(
        send, 200, {"tokens": list(range(count)), "count": count, "max_model_len": CONTEXT_LEN}
    )
