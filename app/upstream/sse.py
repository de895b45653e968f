"""Watching an upstream SSE stream go by without re-serialising it.

``SSEObserver.feed(chunk)`` returns the bytes to relay, normally ``chunk`` itself (same object, no
copy). Per chunk it costs an ``endswith`` and a substring search or two; JSON is parsed only for
the one usage chunk (and a leading error event). What it notices:

* the first ``data:`` event (the commit point, decided by the caller once it is relayed);
* an error event arriving before any data (``data: {"error": ...}``): the attempt failed before
  the commit point and may be retried;
* the usage chunk (``"choices":[]`` + ``"usage"``): token counts; dropped when the gateway forced
  ``include_usage`` and the client did not ask;
* ``data: [DONE]`` at the end, so a stream that stops without it is known to be broken.

Events split across reads are held until their ``\\n\\n`` arrives (an incomplete SSE event is
useless to a client anyway); whole events are never held.
"""

from __future__ import annotations

from dataclasses import dataclass

import orjson

from app.errors import UpstreamStatusError

_DONE = b"data: [DONE]"
_EMPTY_CHOICES = (b'"choices":[]', b'"choices": []')
_MAX_CARRY = 1 << 20


@dataclass(slots=True)
class Usage:
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    reasoning_tokens: int | None = None


def parse_usage(obj: object) -> Usage | None:
    if not isinstance(obj, dict):
        return None
    usage = obj.get("usage")
    if not isinstance(usage, dict):
        return None
    details = usage.get("completion_tokens_details")
    reasoning = usage.get("reasoning_tokens")
    if reasoning is None and isinstance(details, dict):
        reasoning = details.get("reasoning_tokens")

    def _int(v: object) -> int | None:
        return v if isinstance(v, int) and not isinstance(v, bool) else None

    return Usage(
        _int(usage.get("prompt_tokens")), _int(usage.get("completion_tokens")), _int(reasoning)
    )


class SSEObserver:
    __slots__ = ("_carry", "_drop_usage", "chunks", "done", "first_data", "inband_error", "usage")

    def __init__(self, *, drop_usage: bool) -> None:
        self._drop_usage = drop_usage
        self._carry = b""
        self.first_data = False  # a data: event has passed through feed()
        self.done = False
        self.chunks = 0  # data events relayed (approximately: one per upstream write)
        self.usage: Usage | None = None
        self.inband_error = False

    def feed(self, chunk: bytes) -> bytes:
        """Bytes to relay now for this upstream ``chunk`` (may be empty)."""
        if self._carry:
            chunk = self._carry + chunk
            self._carry = b""
        if not chunk.endswith(b"\n\n") and not chunk.endswith(b"\r\n\r\n"):
            cut = chunk.rfind(b"\n\n")
            if cut >= 0:
                chunk, self._carry = chunk[: cut + 2], chunk[cut + 2 :]
            elif len(chunk) < _MAX_CARRY:
                self._carry = chunk
                return b""
        if not self.first_data:
            return self._first(chunk)
        self.chunks += 1
        if b'"usage"' in chunk and (_EMPTY_CHOICES[0] in chunk or _EMPTY_CHOICES[1] in chunk):
            return self._usage(chunk)
        if _DONE in chunk:
            self.done = True
        elif b'{"error"' in chunk:
            self.inband_error = True
        return chunk

    def finish(self) -> bytes:
        """Whatever was held at end of stream (an unterminated last event)."""
        rest, self._carry = self._carry, b""
        if _DONE in rest:
            self.done = True
        return rest

    def _first(self, chunk: bytes) -> bytes:
        at = chunk.find(b"data:")
        if at < 0:
            return chunk  # comments / blank lines before any data: relay as they are
        event = chunk[at + 5 :].lstrip()
        if event.startswith(b'{"error"'):
            raise _leading_error(event)
        self.first_data = True
        self.chunks += 1
        if b'"usage"' in chunk and (_EMPTY_CHOICES[0] in chunk or _EMPTY_CHOICES[1] in chunk):
            return self._usage(chunk)
        if _DONE in chunk:
            self.done = True
        return chunk

    def _usage(self, chunk: bytes) -> bytes:
        """Record the usage event's counts; cut it out of ``chunk`` if the client didn't ask."""
        at = max(chunk.find(_EMPTY_CHOICES[0]), chunk.find(_EMPTY_CHOICES[1]))
        start = chunk.rfind(b"data:", 0, at)
        end = chunk.find(b"\n\n", at)
        end = len(chunk) if end < 0 else end + 2
        try:
            self.usage = parse_usage(orjson.loads(chunk[start + 5 : end].strip()))
        except orjson.JSONDecodeError:
            return chunk
        if _DONE in chunk[end:]:
            self.done = True
        if not self._drop_usage:
            return chunk
        return chunk[:start] + chunk[end:]


def _leading_error(event: bytes) -> UpstreamStatusError:
    end = event.find(b"\n\n")
    raw = event[: end if end >= 0 else len(event)].strip()
    status = 502
    try:
        data = orjson.loads(raw)
        code = data["error"].get("code")
        if isinstance(code, int) and 400 <= code < 600:
            status = code
    except (orjson.JSONDecodeError, AttributeError, KeyError, TypeError):
        pass
    return UpstreamStatusError.from_worker(status, raw)
