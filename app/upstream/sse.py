"""Watching an upstream SSE stream go by without re-serialising it.

``SSEObserver.feed(chunk)`` returns the bytes to relay, normally ``chunk`` itself (same object, no
copy). Per chunk it costs an ``endswith``, one ``count`` and a substring search or two; JSON is
parsed only for the one usage chunk (and a leading error event). What it notices:

* the first ``data:`` event (the commit point, decided by the caller once it is relayed);
* an error event arriving before any data (``data: {"error": ...}``): the attempt failed before
  the commit point and may be retried;
* every ``data:`` event (``events``), so the verify steps of the stream can be estimated;
* the usage chunk (``"choices":[]`` + ``"usage"``): token counts; dropped when the gateway forced
  ``include_usage`` and the client did not ask;
* ``data: [DONE]`` at the end, so a stream that stops without it is known to be broken.

Acceptance length of a stream (``source="estimated"``): SGLang sends one chunk per verify step
and choice (the step's new text), plus per choice a role chunk first and a finish chunk last on
chat streams (``overhead`` = 2 per choice; text completions carry the finish on the last step's
chunk: 0). So ``verify_steps = data events before the usage chunk - overhead`` and
``accept_length = completion_tokens / verify_steps``. Two rare cases cancel in part: a step that
crosses from reasoning to content sends two chunks, a step of only hidden tokens (``</think>``,
tool-call markers, the stop token alone) sends none (with ``logprobs`` it sends one, carrying the
step's log-probabilities); a tool-call step may send two (name, then arguments). Over hundreds of
steps these are well under 1 %; a stream of only a few steps (a bare tool call without reasoning) is
off by up to a step per request, which averages out in the token-weighted fleet figure but not in
its own per-request value. Events are counted with ``bytes.count`` on whole reads; SSE lines start
after a raw newline, which JSON strings never contain.

Events split across reads are held until their blank line (``\\n\\n`` or ``\\r\\n\\r\\n``) arrives
(an incomplete SSE event is useless to a client anyway); whole events are never held. The end of
the stream, ``data: [DONE]``, counts only as a whole event at a line start: a completion whose
text says ``data: [DONE]`` carries it inside a JSON string, never after a raw newline.
Nothing after that event is the client's: ``feed`` returns the read up to its end, and notes
(``after_done``) whether the worker sent more; the relay stops reading the stream there.

Whose answer it is: the gateway sends every attempt with its own ``rid``, and SGLang gives the
answer that id (``answers``). With ``expect`` set to the rid, the stream's first data event must
carry it, else ``feed`` raises ``UpstreamForeignAnswer`` before a byte of it is relayed: a late
stray response on a reused connection is never taken for this request's (one small msgspec
decode of that one event's ``id``, once per stream; later events are not checked).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import msgspec
import orjson

from app.errors import UpstreamForeignAnswer, UpstreamStatusError

_DONE = b"data: [DONE]"
_EVENT = b"\ndata:"
_EMPTY_CHOICES = (b'"choices":[]', b'"choices": []')
_USAGE_OBJECT = (b'"usage":{', b'"usage": {')
_MAX_CARRY = 1 << 20
_ERROR_EVENT = re.compile(rb'(?:^|\n)data:[ \t]*\{"error"')
# The gateway's own field on the client's final usage chunk (``expose_accept_length``).
ACCEPT_LENGTH_FIELD = "spec_accept_length"


@dataclass(slots=True)
class Usage:
    """Token counts of one request as the worker reported them, and its verify steps: exact
    (``meta_info.spec_verify_ct``), estimated from the stream's chunks, or unknown (None)."""

    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    reasoning_tokens: int | None = None
    verify_steps: int | None = None
    exact: bool = False
    # Of prompt_tokens: those served from the worker's prefix cache
    # (``prompt_tokens_details.cached_tokens``; SGLang reports it with --enable-cache-report).
    cached_tokens: int | None = None

    @property
    def accept_length(self) -> float | None:
        """Completion tokens per verify step (SGLang's ``spec_accept_length``)."""
        if not self.verify_steps or self.completion_tokens is None:
            return None
        return self.completion_tokens / self.verify_steps


# No request's tokens or verify steps come near this; a larger count is a broken or hostile
# worker's, and would overflow the float of a metric or charge a tenant's quota for nothing.
MAX_COUNT = 1 << 31


def reported_count(v: object) -> int | None:
    """A count the worker reported (tokens, verify steps): an integer from 0 to ``MAX_COUNT``,
    else None (a negative one would run a counter backwards, which Prometheus refuses)."""
    if isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= MAX_COUNT:
        return v
    return None


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
    prompt = usage.get("prompt_tokens_details")
    return Usage(
        reported_count(usage.get("prompt_tokens")),
        reported_count(usage.get("completion_tokens")),
        reported_count(reasoning),
        cached_tokens=reported_count(prompt.get("cached_tokens"))
        if isinstance(prompt, dict)
        else None,
    )


def take_meta_info(obj: object, *, strip: bool) -> int | None:
    """The request's verify steps from each choice's ``meta_info.spec_verify_ct`` (SGLang's
    ``return_meta_info``); ``meta_info`` is removed from the choices when ``strip``. None when no
    choice reports it (not a speculative-decoding worker, or an older one)."""
    choices = obj.get("choices") if isinstance(obj, dict) else None
    if not isinstance(choices, list):
        return None
    steps: int | None = None
    for choice in choices:
        if not isinstance(choice, dict):
            continue
        meta = choice.pop("meta_info", None) if strip else choice.get("meta_info")
        count = reported_count(meta.get("spec_verify_ct")) if isinstance(meta, dict) else None
        if count is not None and count > 0:
            steps = (steps or 0) + count
    return steps


class _Head(msgspec.Struct):
    id: Any = None


_HEAD = msgspec.json.Decoder(_Head)


def answers(rid: str, answer_id: object) -> bool:
    """Whether ``answer_id`` (the ``id`` of a worker's answer, or of a stream's chunk) is the id
    SGLang gives the answer to a request sent with ``rid``: the rid itself, or ``rid_i`` for the
    i-th prompt of a batch without parallel sampling (``GenerateReqInput._normalize_rid`` in
    ``sglang/srt/managers/io_struct.py``; the OpenAI routes copy ``meta_info["id"]`` into the
    response's ``id``). Parallel samples (``n`` > 1) get fresh random ids there: those answers
    cannot be checked."""
    if not isinstance(answer_id, str) or not answer_id.startswith(rid):
        return False
    rest = answer_id[len(rid) :]
    return not rest or (rest[0] == "_" and rest[1:].isascii() and rest[1:].isdigit())


def event_id(event: bytes) -> Any:
    """The top-level ``id`` of a JSON event (None when it has none or is not JSON)."""
    try:
        return _HEAD.decode(event).id
    except (msgspec.DecodeError, RecursionError):
        return None


def foreign(rid: str, answer_id: object) -> UpstreamForeignAnswer:
    return UpstreamForeignAnswer(
        f"the worker's answer is not the one to request {rid} (its id: {answer_id!r:.80})"
    )


def _events(chunk: bytes) -> int:
    return chunk.count(_EVENT) + chunk.startswith(b"data:")


class StreamState:
    """What the relay reads of a stream's observer, whatever it relays (``SSEObserver`` passes
    the worker's events on; ``app.anthropic.stream`` translates them)."""

    __slots__ = (
        "_carry",
        "after_done",
        "broken",
        "done",
        "events",
        "expect",
        "first_data",
        "hold_errors",
        "inband_error",
        "usage",
    )
    # The observer holds back a worker-fault in-band error itself when ``hold_errors`` is set
    # (``app.proxy.continuation``); else the caller looks for one before feeding it.
    holds_errors = False

    def __init__(self) -> None:
        self._carry = b""  # the start of an event whose end has not arrived
        self.first_data = False  # a data: event has passed through feed() (the commit point)
        self.done = False  # the worker's [DONE] arrived
        self.after_done = False  # ...and the worker sent more after it (never relayed)
        # The rid the stream's first data event must answer (``answers``); None: not checked.
        self.expect: str | None = None
        self.events = 0  # the worker's data: events seen
        self.usage: Usage | None = None
        self.inband_error = False  # the worker sent an error event after the commit point
        # Hold back a worker-fault (5xx) in-band error after the commit point: the stream ends
        # there (``done``) as ``broken``, never relayed, for the stream to be continued.
        self.hold_errors = False
        self.broken: UpstreamStatusError | None = None

    def _framed(self, chunk: bytes) -> tuple[bytes, int] | None:
        """For an observer that reads whole events (``app.anthropic.stream``,
        ``app.responses.stream``): ``chunk`` after what was carried, CRLF line ends made LF, and
        where its last whole event ends (the rest is carried to the next read); None when it
        holds no event end yet (all of it carried). A read of ``_MAX_CARRY`` bytes without one
        counts as whole: a worker cannot make the gateway buffer without bound."""
        if self._carry:
            chunk = self._carry + chunk
            self._carry = b""
        if b"\r" in chunk:
            chunk = chunk.replace(b"\r\n", b"\n")
        end = chunk.rfind(b"\n\n")
        if end < 0:
            if len(chunk) < _MAX_CARRY:
                self._carry = chunk
                return None
            end = len(chunk)
        elif end + 2 < len(chunk):
            self._carry = chunk[end + 2 :]
        return chunk, end

    def resumed(self) -> None:
        """The stream goes on from another attempt (``app.proxy.continuation``): the unfinished
        event the broken one left is dropped (its client never saw it), and so is its end."""
        self._carry = b""
        self.done = self.after_done = False
        self.broken = None

    def hold(self, chunk: bytes) -> bytes | None:
        """``chunk`` up to its first worker-fault error event, which is noted in ``broken`` and
        ends the stream (``done``); None when it has none (a 4xx error event passes)."""
        for match in _ERROR_EVENT.finditer(chunk):
            error = leading_error(chunk[match.end() - len(b'{"error"') :])
            if error.status >= 500:
                self.broken, self.done = error, True
                return chunk[: match.start() + (chunk[match.start()] == 10)]
        return None


class SSEObserver(StreamState):
    __slots__ = ("_drop_usage", "_expose", "_overhead")
    holds_errors = True

    def __init__(self, *, drop_usage: bool, overhead: int = 0, expose: bool = False) -> None:
        super().__init__()
        self._drop_usage = drop_usage
        self._overhead = overhead  # data events per stream that carry no verify step
        self._expose = expose  # add the estimated acceptance length to a relayed usage chunk

    def feed(self, chunk: bytes) -> bytes:
        """Bytes to relay now for this upstream ``chunk`` (may be empty)."""
        if self._carry:
            chunk = self._carry + chunk
            self._carry = b""
        if not chunk.endswith(b"\n\n") and not chunk.endswith(b"\n\r\n"):
            cut = _last_event_end(chunk)
            if cut > 0:
                chunk, self._carry = chunk[:cut], chunk[cut:]
            elif len(chunk) < _MAX_CARRY:
                self._carry = chunk
                return b""
        if not self.first_data:
            return self._first(chunk)
        at = chunk.find(_DONE)
        if at >= 0:
            chunk = self._done(chunk, _done_end(chunk, at, 0))
        self.events += chunk.count(_EVENT) + chunk.startswith(b"data:")
        if b'"usage"' in chunk and (_EMPTY_CHOICES[0] in chunk or _EMPTY_CHOICES[1] in chunk):
            return self._usage(chunk)
        if b'{"error"' in chunk:  # SGLang sends an error event and [DONE] back to back
            if self.hold_errors:
                head = self.hold(chunk)
                if head is not None:
                    return head
            self.inband_error = True
        return chunk

    def _done(self, chunk: bytes, end: int) -> bytes:
        """``chunk`` up to the end of its ``[DONE]`` event (at ``end``; -1: none)."""
        if end < 0:
            return chunk
        self.done = True
        if end < len(chunk):
            self.after_done = self.after_done or bool(chunk[end:].strip())
            return chunk[:end]
        return chunk

    def finish(self) -> bytes:
        """What to relay of the bytes held at the end of the stream: an unterminated last event.
        A final ``data: [DONE]`` line is completed with its blank line; any other event the
        worker never finished is dropped (a client could not use it, and it would run into the
        error event that follows)."""
        rest, self._carry = self._carry, b""
        line = rest.rstrip(b"\r\n")
        if line.endswith(_DONE) and (len(line) == len(_DONE) or line[-len(_DONE) - 1] == 10):
            self.done = True
            return line + (b"\r\n\r\n" if b"\r\n" in rest else b"\n\n")
        return b""

    def _first(self, chunk: bytes) -> bytes:
        at = chunk.find(b"data:")
        if at < 0:
            return chunk  # comments / blank lines before any data: relay as they are
        event = chunk[at + 5 :].lstrip()
        if event.startswith(b'{"error"'):
            raise leading_error(event)
        rid = self.expect
        if rid is not None:
            answer_id = event_id(event[: _event_end(event, 0)])
            if not answers(rid, answer_id):
                raise foreign(rid, answer_id)
        self.first_data = True
        done = chunk.find(_DONE)
        if done >= 0:
            chunk = self._done(chunk, _done_end(chunk, done, 0))
            event = chunk[at + 5 :]
        self.events += _events(chunk)
        if b'"usage"' in chunk and (_EMPTY_CHOICES[0] in chunk or _EMPTY_CHOICES[1] in chunk):
            return self._usage(chunk)
        if b'{"error"' in event:  # a later event of this read (the first one is not an error)
            self.inband_error = True
        return chunk

    def _usage(self, chunk: bytes) -> bytes:
        """Record the usage event's counts and the stream's verify steps; cut the event out of
        ``chunk`` if the client didn't ask for it, else add the acceptance length when enabled."""
        at = max(chunk.find(_EMPTY_CHOICES[0]), chunk.find(_EMPTY_CHOICES[1]))
        start = chunk.rfind(b"data:", 0, at)
        end = _event_end(chunk, at)
        try:
            usage = parse_usage(orjson.loads(chunk[start + 5 : end].strip()))
        except orjson.JSONDecodeError:
            return chunk
        if usage is not None:
            # Events before this one: every chunk of the stream's steps has been seen.
            steps = self.events - _events(chunk[start:]) - self._overhead
            usage.verify_steps = steps if steps > 0 else None
        self.usage = usage
        if self._drop_usage:
            return chunk[:start] + chunk[end:]
        length = usage.accept_length if usage is not None else None
        if not self._expose or length is None:
            return chunk
        return _with_field(chunk, start, end, length)


def _with_field(chunk: bytes, start: int, end: int, length: float) -> bytes:
    """``chunk`` with ``"spec_accept_length": x`` first in the usage object of its usage event."""
    for marker in _USAGE_OBJECT:
        at = chunk.find(marker, start, end)
        if at >= 0:
            cut = at + len(marker)
            field = b'"' + ACCEPT_LENGTH_FIELD.encode() + b'":' + orjson.dumps(round(length, 4))
            rest = chunk[cut:end].lstrip()
            sep = b"" if rest.startswith(b"}") else b","
            return chunk[:cut] + field + sep + chunk[cut:]
    return chunk


def _event_end(chunk: bytes, at: int) -> int:
    """Where the event holding ``chunk[at]`` ends (after its blank line), or ``len(chunk)``."""
    lf, crlf = chunk.find(b"\n\n", at), chunk.find(b"\n\r\n", at)
    if lf >= 0 and (crlf < 0 or lf < crlf):
        return lf + 2
    return crlf + 3 if crlf >= 0 else len(chunk)


def _last_event_end(chunk: bytes) -> int:
    """Where the last whole event of ``chunk`` ends, or -1 if there is none."""
    lf, crlf = chunk.rfind(b"\n\n"), chunk.rfind(b"\n\r\n")
    if lf > crlf:
        return lf + 2
    return crlf + 3 if crlf >= 0 else -1


def _done_end(chunk: bytes, at: int, start: int) -> int:
    """Where the whole event ``data: [DONE]`` of ``chunk`` ends (after its blank line), searching
    from ``at`` (its first occurrence at or after ``start``, an event boundary): at a line start
    and followed by the blank line that ends an event; -1 if there is none. Elsewhere those words
    are text inside a JSON string."""
    while at >= 0:
        end = at + len(_DONE)
        if at == start or chunk[at - 1] == 10:
            if chunk.startswith(b"\n\n", end):
                return end + 2
            if chunk.startswith(b"\r\n\r\n", end):
                return end + 4
        at = chunk.find(_DONE, end)
    return -1


def leading_error(event: bytes) -> UpstreamStatusError:
    raw = event[: _event_end(event, 0)].strip()
    status = 502
    try:
        data = orjson.loads(raw)
        code = data["error"].get("code")
        if isinstance(code, int) and 400 <= code < 600:
            status = code
    except (orjson.JSONDecodeError, AttributeError, KeyError, TypeError):
        pass
    return UpstreamStatusError.from_worker(status, raw)
