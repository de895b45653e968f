"""What the client has of a broken stream's answer (``Partial``, read from the relayed events
only once it broke), and the chat bodies that go on from it (``continuation_body``,
``reasoning_closed``); see ``app.proxy.continuation``."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import orjson

_EVENT_END = re.compile(rb"\r?\n\r?\n")
_ERROR_EVENT = re.compile(rb'(?:^|\n)data:[ \t]*\{"error"')
_CHARS_PER_TOKEN = 4


@dataclass(slots=True)
class Partial:
    """What the client has of the answer so far, read from the relayed events."""

    id: str | None = None
    reasoning: str = ""
    content: str = ""
    steps: int = 0  # data events that carried text
    tool_calls: bool = False
    finished: bool = False  # a finish_reason (or [DONE]) was relayed
    role: bool = False  # the role chunk was relayed

    @property
    def continuable(self) -> bool:
        return self.id is not None and self.role and not self.tool_calls and not self.finished

    @property
    def tokens(self) -> int:
        """Estimated completion tokens streamed: a token per 4 characters, at least one per
        step (SGLang sends one chunk per verify step)."""
        chars = len(self.reasoning) + len(self.content)
        return max(self.steps, -(-chars // _CHARS_PER_TOKEN))

    def prefix(self) -> str:
        """The partial answer as the assistant's raw text (see the module doc)."""
        if not self.reasoning:
            return self.content
        if not self.content:
            return "<think>" + self.reasoning
        return "<think>" + self.reasoning + "</think>" + self.content


def _whole(data: bytes) -> bytes:
    """``data`` up to the end of its last whole event."""
    ends = list(_EVENT_END.finditer(data))
    return data[: ends[-1].end()] if ends else b""


def _events(data: bytes) -> list[bytes]:
    return [e for e in _EVENT_END.split(data) if e.strip()]


def _payload(event: bytes) -> bytes | None:
    """The data of an SSE event (None: a comment or other field only)."""
    lines = [ln[5:].strip() for ln in event.splitlines() if ln.startswith(b"data:")]
    return b"".join(lines) if lines else None


def read_partial(data: bytes) -> Partial:
    """The answer so far in the relayed chat events ``data`` (whole events only)."""
    part = Partial()
    reasoning: list[str] = []
    content: list[str] = []
    for event in _events(data):
        payload = _payload(event)
        if payload is None:
            continue
        if payload == b"[DONE]":
            part.finished = True
            continue
        try:
            doc = orjson.loads(payload)
        except orjson.JSONDecodeError:
            continue
        if not isinstance(doc, dict):
            continue
        if part.id is None and isinstance(doc.get("id"), str):
            part.id = doc["id"]
        for choice in doc.get("choices") or ():
            if not isinstance(choice, dict):
                continue
            if choice.get("finish_reason") is not None:
                part.finished = True
            delta = choice.get("delta")
            if not isinstance(delta, dict):
                continue
            if delta.get("role"):
                part.role = True
            if delta.get("tool_calls"):
                part.tool_calls = True
            text = False
            if isinstance(delta.get("reasoning_content"), str) and delta["reasoning_content"]:
                reasoning.append(delta["reasoning_content"])
                text = True
            if isinstance(delta.get("content"), str) and delta["content"]:
                content.append(delta["content"])
                text = True
            part.steps += text
    part.reasoning, part.content = "".join(reasoning), "".join(content)
    return part


def reasoning_closed(body: dict[str, Any], part: Partial) -> bytes:
    """The chat request ``body`` continued with ``part``'s reasoning closed (``<think>``
    reasoning ``</think>``, no answer), without a rid: its prompt tokens less an attempt's are
    the reasoning tokens from that attempt's start to the ``</think>`` (see the module doc)."""
    out = dict(body)
    out.pop("rid", None)
    messages = list(out.get("messages") or ())
    messages.append({"role": "assistant", "content": "<think>" + part.reasoning + "</think>"})
    out["messages"] = messages
    out["continue_final_message"] = True
    return orjson.dumps(out)


def continuation_body(body: dict[str, Any], part: Partial) -> dict[str, Any] | None:
    """The chat request ``body`` (as sent upstream) continued after ``part``, without a rid;
    None for a request that itself continues a final assistant message (not continued)."""
    if body.get("continue_final_message") is True:
        return None
    out = dict(body)
    out.pop("rid", None)
    messages = list(out.get("messages") or ())
    messages.append({"role": "assistant", "content": part.prefix()})
    out["messages"] = messages
    out["continue_final_message"] = True
    for name in ("max_tokens", "max_completion_tokens"):
        asked = out.get(name)
        if isinstance(asked, int) and not isinstance(asked, bool):
            out[name] = max(1, asked - part.tokens)
    return out
