"""A worker's chat chunk's choice, checked before any of it reaches the Responses stream.

A chunk that is not a chat chunk (a delta or tool call of the wrong types) is a broken worker:
``UpstreamBadResponse``, retried before the commit point, ``response.failed`` after it.
"""

from __future__ import annotations

from typing import Any

from app.errors import UpstreamBadResponse


def bad(what: str) -> UpstreamBadResponse:
    return UpstreamBadResponse(f"a worker sent a stream event with {what}")


def _str(value: Any, what: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    raise bad(what)


class Delta:
    """A chunk's choice, checked: nothing is written until the whole chunk passed."""

    __slots__ = ("calls", "finish", "reasoning", "text")

    def __init__(self, choice: Any) -> None:
        if not isinstance(choice, dict):
            raise bad("a choice that is not an object")
        delta = choice.get("delta")
        if delta is None:
            delta = {}
        elif not isinstance(delta, dict):
            raise bad("a delta that is not an object")
        # SGLang's reasoning_content; vLLM's reasoning (newer) or both (the same text).
        reasoning = delta.get("reasoning_content")
        if reasoning is None:
            reasoning = delta.get("reasoning")
        self.reasoning = _str(reasoning, "a non-string reasoning_content")
        self.text = _str(delta.get("content"), "a non-string content")
        calls = delta.get("tool_calls")
        self.calls: list[tuple[Any, str | None, str | None, str | None]] = []
        if calls is not None:
            if not isinstance(calls, list):
                raise bad("tool_calls that are not a list")
            for call in calls:
                function = call.get("function") if isinstance(call, dict) else None
                if not isinstance(call, dict) or not isinstance(function, dict | None):
                    raise bad("a malformed tool call")
                function = function or {}
                index = call.get("index")
                if index is not None and (not isinstance(index, int) or isinstance(index, bool)):
                    raise bad("a tool call index that is not an integer")
                self.calls.append(
                    (
                        index,
                        _str(call.get("id"), "a non-string tool call id"),
                        _str(function.get("name"), "a non-string tool name"),
                        _str(function.get("arguments"), "non-string tool arguments"),
                    )
                )
        self.finish = _str(choice.get("finish_reason"), "a non-string finish_reason")
