"""A continuation's stream turned into the rest of the client's (``Resume``); see
``app.proxy.continuation``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import orjson

from app.errors import UpstreamBadResponse
from app.proxy.continuation.kept import ContinuedUsage, KeptReads
from app.proxy.continuation.partial import _events, _payload, _whole
from app.upstream.sse import answers, foreign, leading_error, parse_usage


class Resume:
    """Turns a continuation's stream into the rest of the client's (see the module doc). Holds
    an unfinished event until its end arrives, like the observers do."""

    __slots__ = ("_carry", "_checked", "_first_id", "_role_dropped", "_stream", "rid", "usage")

    def __init__(self, first_id: str, stream: KeptReads) -> None:
        self._first_id = first_id
        self.rid = ""  # the continuation attempt's own, set when it starts
        self._stream = stream
        self.usage: ContinuedUsage | None = None  # the stream's counts, once the usage chunk passed
        self._carry = b""
        self._checked = False
        self._role_dropped = False

    def wrap(self, feed: Callable[[bytes], bytes]) -> Callable[[bytes], bytes]:
        def feeding(chunk: bytes) -> bytes:
            out = self.feed(chunk)
            return feed(out) if out else b""

        return feeding

    def feed(self, chunk: bytes) -> bytes:
        data = self._carry + chunk
        whole = _whole(data)
        self._carry = data[len(whole) :]
        if not whole:
            return b""
        out: list[bytes] = []
        for event in _events(whole):
            payload = _payload(event)
            if payload is None or payload == b"[DONE]":
                out.append(event + b"\n\n")
                continue
            if payload.startswith(b'{"error"') and not self._checked:
                raise leading_error(payload + b"\n\n")
            out.append(self._event(payload))
        return b"".join(out)

    def finish(self) -> bytes:
        rest, self._carry = self._carry, b""
        return rest if rest.strip().endswith(b"[DONE]") else b""

    def _event(self, payload: bytes) -> bytes:
        try:
            doc = orjson.loads(payload)
        except orjson.JSONDecodeError:
            raise UpstreamBadResponse("a continuation chunk is not JSON") from None
        if not isinstance(doc, dict):
            raise UpstreamBadResponse("a continuation chunk is not a JSON object")
        if "error" in doc:
            return b"data: " + payload + b"\n\n"
        if not self._checked:
            if not answers(self.rid, doc.get("id")):
                raise foreign(self.rid, doc.get("id"))
            self._checked = True
        doc["id"] = self._first_id
        choices = doc.get("choices")
        if not self._role_dropped and isinstance(choices, list) and choices:
            choice = choices[0]
            delta = choice.get("delta") if isinstance(choice, dict) else None
            if isinstance(delta, dict) and delta.get("role"):
                self._role_dropped = True
                if (
                    not delta.get("content")
                    and not delta.get("reasoning_content")
                    and not delta.get("tool_calls")
                    and choice.get("finish_reason") is None
                ):
                    return b""
                delta.pop("role", None)
        usage = doc.get("usage")
        if isinstance(usage, dict) and "completion_tokens" in usage:
            counts = parse_usage(doc)
            whole = None
            if counts is not None:
                whole = self._stream.usage(
                    counts.prompt_tokens, counts.completion_tokens, counts.reasoning_tokens
                )
            if whole is not None:
                self.usage = whole
                usage["prompt_tokens"] = whole.prompt_tokens
                usage["completion_tokens"] = whole.completion_tokens
                usage["total_tokens"] = whole.prompt_tokens + whole.completion_tokens
                _set_reasoning(usage, whole.reasoning_tokens)
        return b"data: " + orjson.dumps(doc) + b"\n\n"


def _set_reasoning(usage: dict[str, Any], reasoning: int | None) -> None:
    """The stream's reasoning tokens into the usage where the worker put its own: SGLang's
    top-level ``reasoning_tokens`` and ``completion_tokens_details.reasoning_tokens``."""
    if reasoning is None:
        return
    if "reasoning_tokens" in usage:
        usage["reasoning_tokens"] = reasoning
    details = usage.get("completion_tokens_details")
    if isinstance(details, dict):
        details["reasoning_tokens"] = reasoning
    elif reasoning and "completion_tokens_details" in usage:  # null: the last attempt had none
        usage["completion_tokens_details"] = {"reasoning_tokens": reasoning}
