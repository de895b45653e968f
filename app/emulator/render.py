"""SGLang's exact response bytes: SSE chunks and JSON bodies for chat and text completions.

Two chunk shapes exist in SGLang and both are reproduced: the msgspec fast path
(``build_sse_content``: ``delta`` always carries ``reasoning_content``, omits unset ``role``/
``content``, no top-level ``usage`` unless set) for role, reasoning, content and finish chunks; and
the pydantic ``ChatCompletionStreamResponse`` dump (every delta field, ``"usage": null``) for
tool-call chunks, content chunks while tool parsing is active, usage chunks and all text
completion chunks.

With ``vllm=True`` the same content comes in vLLM's shape (``app.emulator.vllm``).
"""

from __future__ import annotations

import json
import uuid
from http import HTTPStatus
from typing import Any

import orjson

from app.emulator.asgi import SSE_HEADERS, Send, respond_json
from app.emulator.generation import ToolDelta
from app.emulator.vllm import to_vllm_choice, to_vllm_usage

DONE = b"data: [DONE]\n\n"


def sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def error_body(message: str, err_type: str, code: int, *, vllm: bool = False) -> dict[str, Any]:
    """SGLang's ``ErrorResponse`` (``{"object": "error", ...}``); vLLM's nests it under
    ``error`` (``{"error": {"message", "type", "param", "code"}}``)."""
    if vllm:
        return {"error": {"message": message, "type": err_type, "param": None, "code": code}}
    return {"object": "error", "message": message, "type": err_type, "param": None, "code": code}


def error_event(message: str, err_type: str, code: int) -> bytes:
    """SGLang's in-band stream error (``json.dumps`` of ``{"error": ErrorResponse}``)."""
    return ("data: " + json.dumps({"error": error_body(message, err_type, code)}) + "\n\n").encode()


async def send_queue_full(
    send: Send, stream: bool, message: str = "The request queue is full."
) -> None:
    """SGLang's answer when its scheduler aborts a request it will not queue (the waiting queue
    is full, evicted by a higher priority, a priority it does not take): non-streaming, HTTP 503
    with an ``ErrorResponse``; streaming, HTTP 200 with one in-band 503 error event and
    ``[DONE]``."""
    if not stream:
        await respond_json(send, 503, error_body(message, "503", 503))
        return
    await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
    event = error_event(message, "SERVICE_UNAVAILABLE", 503)
    await send({"type": "http.response.body", "body": event, "more_body": True})
    await send({"type": "http.response.body", "body": DONE})


async def send_abort(send: Send, stream: bool, message: str, status: int) -> None:
    """A request SGLang's scheduler aborted with a status (``prepare_abort``): non-streaming, a
    400 is an ``ErrorResponse`` of type "BadRequestError" (``ValueError`` in the tokenizer
    manager), any other status one whose type is the status (``HTTPException``); streaming,
    HTTP 200 with one in-band error event typed with the status's name, then ``[DONE]``."""
    if not stream:
        err_type = "BadRequestError" if status == 400 else str(status)
        await respond_json(send, status, error_body(message, err_type, status))
        return
    await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
    event = error_event(message, HTTPStatus(status).name, status)
    await send({"type": "http.response.body", "body": event, "more_body": True})
    await send({"type": "http.response.body", "body": DONE})


def usage(
    prompt: int, completion: int, reasoning: int, cached: int | None, *, drop_none: bool = False
) -> dict[str, Any]:
    out: dict[str, Any] = {
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
        "prompt_tokens_details": None if cached is None else {"cached_tokens": cached},
        "reasoning_tokens": reasoning,
        "completion_tokens_details": {"reasoning_tokens": reasoning} if reasoning else None,
    }
    if drop_none:
        return {k: v for k, v in out.items() if v is not None}
    return out


class ChatChunks:
    """Chunk bytes for one choice of a chat stream (``index``; ``rid`` is its request id)."""

    def __init__(
        self,
        rid: str,
        created: int,
        model: str,
        tools_active: bool,
        index: int = 0,
        *,
        vllm: bool = False,
    ) -> None:
        chunk_id = vllm_id("chatcmpl-") if vllm else rid
        self._head = {"id": chunk_id, "object": "chat.completion.chunk", "created": created}
        self._model = model
        self.tools_active = tools_active
        self.index = index
        self.vllm = vllm

    def _chunk(self, head: dict[str, Any], choice: dict[str, Any], use: Any) -> bytes:
        if self.vllm:
            chunk = {**head, "model": self._model, "choices": [to_vllm_choice(choice)]}
            if use is not None:
                chunk["usage"] = to_vllm_usage(use)
            return sse(chunk)
        return sse({**head, "model": self._model, "choices": [choice], "usage": use})

    def _fast(
        self,
        delta: dict[str, Any],
        finish: str | None,
        matched: Any,
        use: dict[str, Any] | None,
        logprobs: dict[str, Any] | None = None,
        chunk_id: str | None = None,
    ) -> bytes:
        choice = {
            "index": self.index,
            "delta": delta,
            "logprobs": logprobs,
            "finish_reason": finish,
            "matched_stop": matched,
        }
        head = self._head if chunk_id is None else {**self._head, "id": chunk_id}
        if self.vllm:
            return self._chunk(head, choice, use)
        chunk = {**head, "model": self._model, "choices": [choice]}
        if use is not None:
            chunk["usage"] = use
        return sse(chunk)

    def _full(self, delta: dict[str, Any], use: dict[str, Any] | None) -> bytes:
        full = {"role": None, "content": None, "reasoning_content": None, **delta}
        choice = {
            "index": self.index,
            "delta": full,
            "logprobs": None,
            "finish_reason": None,
            "matched_stop": None,
        }
        return self._chunk(self._head, choice, use)

    def role(self) -> bytes:
        delta = {"reasoning_content": None, "role": "assistant", "content": ""}
        return self._fast(delta, None, None, None)

    def reasoning(
        self, text: str, use: dict[str, Any] | None = None, logprobs: dict[str, Any] | None = None
    ) -> bytes:
        return self._fast({"reasoning_content": text}, None, None, use, logprobs)

    def content(
        self, text: str, use: dict[str, Any] | None = None, logprobs: dict[str, Any] | None = None
    ) -> bytes:
        """A content chunk; with tool parsing active SGLang's parser builds it (no logprobs)."""
        if self.tools_active:
            return self._full({"content": text}, use)
        return self._fast({"reasoning_content": None, "content": text}, None, None, use, logprobs)

    def logprobs(self, logprobs: dict[str, Any], use: dict[str, Any] | None = None) -> bytes:
        """A step's log-probabilities that no text chunk carried (SGLang's flush chunk)."""
        return self._fast({"reasoning_content": None}, None, None, use, logprobs)

    def tool(self, delta: ToolDelta, use: dict[str, Any] | None = None) -> bytes:
        call = {
            "id": delta.id,
            "index": delta.index,
            "type": "function",
            "function": {"name": delta.name, "arguments": delta.arguments},
        }
        return self._full({"tool_calls": [call]}, use)

    def finish(self, reason: str, matched: int | str | None, chunk_id: str | None = None) -> bytes:
        """The finish chunk; SGLang sends them after the last output, under that output's id."""
        return self._fast({"reasoning_content": None}, reason, matched, None, chunk_id=chunk_id)

    def usage(self, use: dict[str, Any], chunk_id: str | None = None) -> bytes:
        head = self._head if chunk_id is None else {**self._head, "id": chunk_id}
        if self.vllm:
            use = to_vllm_usage(use) or use
        return sse({**head, "model": self._model, "choices": [], "usage": use})


class CompletionChunks:
    """Chunk bytes for one choice of a text-completion stream."""

    def __init__(
        self, rid: str, created: int, model: str, index: int = 0, *, vllm: bool = False
    ) -> None:
        head_id = vllm_id("cmpl-") if vllm else rid
        self._head = {
            "id": head_id,
            "object": "text_completion",
            "created": created,
            "model": model,
        }
        self.index = index
        self.vllm = vllm

    def text(
        self,
        text: str,
        finish: str | None = None,
        matched: int | str | None = None,
        use: dict[str, Any] | None = None,
        logprobs: dict[str, Any] | None = None,
    ) -> bytes:
        choice = {
            "index": self.index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": finish,
            "matched_stop": matched,
        }
        if self.vllm:
            return sse(
                {**self._head, "choices": [to_vllm_choice(choice)], "usage": to_vllm_usage(use)}
            )
        return sse({**self._head, "choices": [choice], "usage": use})

    def usage(self, use: dict[str, Any], chunk_id: str | None = None) -> bytes:
        head = self._head if chunk_id is None else {**self._head, "id": chunk_id}
        if self.vllm:
            use = to_vllm_usage(use) or use
        return sse({**head, "choices": [], "usage": use})


def chat_choice(
    index: int,
    message: dict[str, Any],
    finish: str | None,
    matched: int | str | None,
    meta_info: dict[str, Any] | None = None,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    choice: dict[str, Any] = {
        "index": index,
        "message": message,
        "logprobs": logprobs,
        "finish_reason": finish,
        "matched_stop": matched,
    }
    if meta_info is not None:
        choice["meta_info"] = meta_info
    return choice


def chat_response(
    rid: str,
    created: int,
    model: str,
    choices: list[dict[str, Any]],
    use: dict[str, Any],
    *,
    vllm: bool = False,
) -> dict[str, Any]:
    if vllm:
        return _vllm_document("chat.completion", rid, created, model, choices, use)
    return {
        "id": rid,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": use,
        "metadata": {"weight_version": "default"},
    }


def completion_choice(
    index: int,
    text: str,
    finish: str | None,
    matched: int | str | None,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    return {
        "index": index,
        "text": text,
        "logprobs": logprobs,
        "finish_reason": finish,
        "matched_stop": matched,
    }


def completion_response(
    rid: str,
    created: int,
    model: str,
    choices: list[dict[str, Any]],
    use: dict[str, Any],
    *,
    vllm: bool = False,
) -> dict[str, Any]:
    if vllm:
        return _vllm_document("text_completion", rid, created, model, choices, use)
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": use,
        "metadata": {"weight_version": "default"},
    }


def vllm_id(prefix: str) -> str:
    """An id as vLLM's OpenAI server makes it: the route's prefix and a random uuid (it never sees
    SGLang's ``rid``), so the gateway cannot tie a vLLM answer to its attempt by id."""
    return prefix + uuid.uuid4().hex


def _vllm_document(
    kind: str,
    rid: str,
    created: int,
    model: str,
    choices: list[dict[str, Any]],
    use: dict[str, Any],
) -> dict[str, Any]:
    """vLLM's response document: its choice shape, no SGLang ``metadata``, its own id."""
    return {
        "id": vllm_id("chatcmpl-" if kind == "chat.completion" else "cmpl-"),
        "object": kind,
        "created": created,
        "model": model,
        "choices": [to_vllm_choice(c) for c in choices],
        "usage": to_vllm_usage(use),
        "prompt_logprobs": None,
        "kv_transfer_params": None,
    }
