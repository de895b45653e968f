"""A worker's chat stream, event by event, as the Responses API's stream.

``ResponsesStream`` has the relay's observer shape (``app.proxy.surface.Observer``); the events it
writes and their grammar are ``app.responses.events``. An output item ``reasoning`` comes from
``reasoning_content``, ``message`` from ``content``, ``function_call`` from ``tool_calls``. The
worker's first chat chunk becomes ``response.created`` (the commit point); its usage chunk (the
gateway always asks for one) gives the last event its usage and the acceptance-length estimate
its steps; its ``[DONE]`` ends the response. A worker's error event before the first chunk is
raised (the attempt may be retried); after it, it ends the stream with ``response.failed``. So
does any gateway failure after the commit point (``fail``, called through the request's error
shape). A chunk that is not a chat chunk (``choices`` not a list of objects, or a choice that
``app.responses.chunk`` rejects) is a broken worker: ``UpstreamBadResponse``, retried before the
commit point, ``response.failed`` after it. An event is checked whole before any of its events
is written; the events of a read before a broken one go out, the failure with the next read (or
the stream's end), so sequence numbers never skip.

Cost per chunk: for the common delta (one text or reasoning delta of the open item's kind, in
SGLang's layout) no parse of the worker's event: its JSON string literal is cut out, checked to be
one string, and written as it is between bytes prepared when its item opened; no dict is built.
Other events get one orjson parse each. At saturation a whole stream arrives in a read or two,
so a read's run of such deltas is done in one pass (``_run``) instead of one ``_quick`` each: the
read cut at event ends (one ``split``), the run checked by rebuilding it from its literals (one
``join`` and one compare: SGLang repeats the bytes around a delta verbatim within a stream),
every literal checked at once (one orjson parse of them as an array: exactly one string each),
the client's events built from prepared bytes and joined once with the read's others. What is
not exactly such a run goes event by event; either way the client gets the same bytes and the
same errors (``tests/responses/test_stream.py`` compares them, hostile literals included). A
run is looked for once per item and read, in windows of bounded size, so a read that is none
costs a bounded amount more.
"""

from __future__ import annotations

from itertools import chain, compress, repeat
from operator import and_
from typing import Any

import orjson

from app.errors import GatewayError, UpstreamError
from app.responses.chunk import Delta, bad
from app.responses.events import END, SEQ, EventWriter
from app.responses.response import Context
from app.upstream.sse import answers, foreign, leading_error
from app.upstream.usage import parse_usage

_OVERHEAD = 2  # the role chunk and the finish chunk carry no verify step
# The common worker chunk (``_quick``): one content or reasoning delta, as SGLang lays it out.
_FAST_CHOICE = b'"choices":[{"index":0,"delta":{'
_CONTENT = b'"content":'
_REASONING = b'"reasoning_content":'
# An item's ``_marker`` by its kind: what precedes a delta's string in ``_quick``.
_MARKERS = {"message": _FAST_CHOICE + _CONTENT, "reasoning": _FAST_CHOICE + _REASONING}
_FAST_END = b'"},"logprobs":null,"finish_reason":null,"matched_stop":null}]}'
_FAST_START = b'data: {"id":'
_CUT = 1 - len(_FAST_END)  # the delta's JSON string ends where _FAST_END begins, after its quote
_TAIL = b'"' + SEQ + b"%d" + END  # a delta event's end, from its literal's closing quote
_TAILS: list[bytes] = []  # _TAIL for the sequence numbers 0, 1, ... (grown on demand)
_MAX_TAILS = 1 << 14
_RUN_END = _FAST_END[-3:] + b"\n\n"  # where ``_run`` cuts: the end of an event, its blank line
_RUN_TAIL = _FAST_END[:-3]  # a common delta's end from its literal's closing quote to _RUN_END
# The bytes a ``_run`` looks at first, then at a time while the run goes on: what a read that
# is no run costs is bounded, whatever its size.
_RUN_FIRST = 1 << 14
_RUN_WINDOW = 1 << 16


def _tails(seq: int, count: int) -> list[bytes]:
    """``_TAIL`` for ``count`` sequence numbers from ``seq``."""
    stop = seq + count
    if stop > len(_TAILS) and stop <= _MAX_TAILS:
        _TAILS.extend(map(_TAIL.__mod__, range(len(_TAILS), stop)))
    if stop <= len(_TAILS):
        return _TAILS[seq:stop]
    return list(map(_TAIL.__mod__, range(seq, stop)))


class ResponsesStream(EventWriter):
    __slots__ = ("_failed", "_marker", "_pending", "_prefix", "_steps")

    def __init__(self, ctx: Context, *, expose: bool = False) -> None:
        super().__init__(ctx, expose=expose)
        self._marker: bytes | None = None  # what precedes a delta's string in ``_quick``
        # The worker's common delta event up to its literal, as this item's first one had it
        # (``_quick``; ``_run`` looks for it); None: not seen yet.
        self._prefix: bytes | None = None
        self._steps = 0  # chat data events with choices
        self._failed = False
        self._pending: UpstreamError | None = None  # raised at the next read (see ``feed``)

    # -- the relay's side ----------------------------------------------------------------------

    def feed(self, chunk: bytes) -> bytes:
        if self._pending is not None:
            raise self._pending
        framed = self._framed(chunk)
        if framed is None:
            return b""
        chunk, end = framed
        if chunk.find(b"\n\n") == end:  # one event (the worker writes them one by one)
            quick = self._quick(chunk[:end])
            if quick is not None:
                return quick
        region = chunk[:end]
        out: list[bytes] = []
        begun = self.first_data
        pos = 0
        tried = None  # the item's ``_prefix`` a ``_run`` looked for (once per item and read)
        try:
            while pos <= end:  # the events of ``region``, as ``region.split(b"\n\n")`` has them
                prefix = self._prefix
                if prefix is not None and prefix is not tried and region.startswith(prefix, pos):
                    tried = prefix
                    after = self._run(region, pos, out)
                    if after > pos:
                        pos = after
                        continue
                cut = region.find(b"\n\n", pos)
                if cut < 0:
                    cut = end
                event = region[pos:cut]
                pos = cut + 2
                if self.done:  # the worker's stream has ended: nothing after it is the client's
                    self.after_done = self.after_done or bool(event.strip())
                    continue
                quick = self._quick(event)
                if quick is None:
                    at = event.find(b"data:")
                    if at >= 0:
                        self._data(event[at + 5 :].strip(), out)
                elif quick:
                    out.append(quick)
        except UpstreamError as exc:
            if not begun or not out:
                raise  # nothing of this read reaches the client
            # The events before the broken one go out whole; the failure with the next read.
            self._pending = exc
        if self.done and self._carry:
            self.after_done = self.after_done or bool(self._carry.strip())
            self._carry = b""
        if out and self.first_data:
            self._ctx.current = self  # the stream the client is reading (for ``fail``)
        return b"".join(out)

    def _quick(self, event: bytes) -> bytes | None:
        """The steady state without parsing the worker's event: one text or reasoning delta of
        the open item's kind, nothing else, in SGLang's layout. Its JSON string is cut out,
        checked to be exactly one string (one small parse) and written into the client's event
        as it is. None: any other event (parsed whole by ``_data``)."""
        marker = self._marker
        if marker is None or not event.endswith(_FAST_END):
            return None
        at = event.find(marker)
        if at < 0 or not event.startswith(_FAST_START):
            return None
        literal = event[at + len(marker) : _CUT]
        try:
            text = orjson.loads(literal)
        except orjson.JSONDecodeError:
            return None
        if text.__class__ is not str:
            return None
        self.events += 1
        self._steps += 1
        if self._prefix is None:
            self._prefix = event[: at + len(marker)]
        if not text:
            return b""
        self._pieces.append(text)
        seq = self._seq
        self._seq = seq + 1
        return self._head + literal + SEQ + b"%d" % seq + END

    def _run(self, region: bytes, pos: int, out: list[bytes]) -> int:
        """The run of common deltas at ``pos`` (an event's start, where ``_prefix`` is), in
        one pass; returns where the next event starts (``pos``: nothing done, the events go one
        by one). The region is cut at every end of an event that could be a common delta
        (``_RUN_END``: its last bytes and the blank line); the run is the leading pieces that are
        each ``_prefix``, a literal and ``_RUN_TAIL``, exactly the event ``_quick`` takes whole:
        checked at once by rebuilding the run from the literals, else piece by piece. Its
        literals, a raw newline between each two (never inside a JSON string, so none can run
        on into the next), must parse as an array of exactly as many strings, and hold no
        newline themselves (which could hide an event's end); else nothing is done."""
        prefix = self._prefix
        assert prefix is not None
        cut = slice(len(prefix), -len(_RUN_TAIL))  # a piece's literal, less its closing quote
        glue = _RUN_TAIL + _RUN_END + prefix  # between two literals of a run
        size = _RUN_FIRST
        while True:
            window = region[pos : pos + size]
            pieces = window.split(_RUN_END)
            pieces.pop()  # not followed by an event's end here: the next window's, or alone
            ends = False
            for _ in range(2):  # commonly the stream's last events (finish, usage) end the run
                if pieces and not (
                    pieces[-1].startswith(prefix) and pieces[-1].endswith(_RUN_TAIL)
                ):
                    pieces.pop()
                    ends = True
            literals = list(map(bytes.__getitem__, pieces, repeat(cut)))
            rebuilt = glue.join(literals)
            if not (
                window.startswith(prefix)
                and window.startswith(rebuilt, len(prefix))
                and window.startswith(_RUN_TAIL + _RUN_END, len(prefix) + len(rebuilt))
            ):  # not every piece is a common delta: the run ends at the first that is not
                whole = list(
                    map(
                        and_,
                        map(bytes.startswith, pieces, repeat(prefix)),
                        map(bytes.endswith, pieces, repeat(_RUN_TAIL)),
                    )
                )
                if False in whole:
                    ends = True
                    del pieces[whole.index(False) :]
                    del literals[len(pieces) :]
            count = len(pieces)
            if count < 2:
                return pos  # one event: ``_quick`` does as well
            # A newline in each separator: no string can run on into the next literal (a raw
            # newline is not JSON in a string), and none may be in a literal.
            joined = b'"\n,'.join(literals)
            if joined.count(b"\n") != count - 1:
                return pos
            try:
                texts = orjson.loads(b"[" + joined + b'"]')
            except orjson.JSONDecodeError:
                return pos
            if len(texts) != count:
                return pos
            try:
                text = "".join(texts)
            except TypeError:  # not all strings
                return pos
            self.events += count
            self._steps += count
            if text:
                self._pieces.append(text)
                if "" in texts:
                    literals = list(compress(literals, texts))  # an empty delta writes no event
                seq = self._seq
                self._seq = seq + len(literals)
                parts = zip(repeat(self._head), literals, _tails(seq, len(literals)))
                out.extend(chain.from_iterable(parts))  # joined once, with the read's others
            pos += sum(map(len, pieces)) + count * len(_RUN_END)
            if ends or len(window) < size:
                return pos
            size = _RUN_WINDOW

    def finish(self) -> bytes:
        """A last ``data: [DONE]`` without its blank line still ends the response."""
        if self._pending is not None:
            raise self._pending
        rest, self._carry = self._carry.strip(), b""
        out: list[bytes] = []
        if rest.startswith(b"data:") and rest[5:].strip() == b"[DONE]":
            self._data(b"[DONE]", out)
        return b"".join(out)

    def fail(self, error: GatewayError) -> bytes:
        """The stream's last events for a failure after it began: ``response.failed`` (after
        ``response.created`` if the client has not seen it); nothing once it ended."""
        if self._finished:
            return b""
        self._finished = self._failed = True
        self._kind = self._marker = self._prefix = None  # no delta may follow (``_quick``)
        out: list[bytes] = []
        if not self.first_data:
            self._begin(out)
        response = self._response("failed")
        code = "rate_limit_exceeded" if error.status == 429 else "server_error"
        response["error"] = {"code": code, "message": error.client_message, "type": error.code}
        out.append(self._event({"type": "response.failed", "response": response}))
        return b"".join(out)

    # -- the worker's events -------------------------------------------------------------------

    def _data(self, payload: bytes, out: list[bytes]) -> None:
        self.events += 1
        if payload == b"[DONE]":
            if not self.first_data:
                raise bad("nothing before [DONE]")
            self.done = True
            if not self._finished:
                self._end(out)
            return
        if self._finished:
            return
        try:
            obj = orjson.loads(payload)
        except orjson.JSONDecodeError:
            raise bad("invalid JSON") from None
        if not isinstance(obj, dict):
            raise bad("JSON that is not an object")
        choices = obj.get("choices")
        if "error" in obj and choices is None:
            error = leading_error(payload)
            if not self.first_data:
                raise error
            self.inband_error = True
            out.append(self.fail(error))
            return
        if not choices:
            if choices is not None and not isinstance(choices, list):
                raise bad("choices that are not a list")
            self._usage(obj)
            return
        if not isinstance(choices, list):
            raise bad("choices that are not a list")
        delta = Delta(choices[0])
        if not self.first_data:
            rid = self.expect
            if rid is not None and not answers(rid, obj.get("id")):
                raise foreign(rid, obj.get("id"))
            self._begin(out)
        self._steps += 1
        if delta.reasoning:
            self._reasoning(delta.reasoning, out)
        if delta.text:
            self._text(delta.text, out)
        for call in delta.calls:
            self._call(call, out)
        if delta.finish is not None:
            self._finish = delta.finish
        if obj.get("usage") is not None:
            self._usage(obj)

    def _usage(self, obj: dict[str, Any]) -> None:
        if obj.get("usage") is None:
            return
        self._raw_usage = obj["usage"]
        self.usage = parse_usage(obj)
        if self.usage is not None:
            steps = self._steps - _OVERHEAD
            self.usage.verify_steps = steps if steps > 0 else None

    # -- the open item's fast path -------------------------------------------------------------

    def _open(self, kind: str, item: dict[str, Any], out: list[bytes]) -> None:
        super()._open(kind, item, out)
        self._prefix = None
        self._marker = _MARKERS.get(kind)

    def _close(self, out: list[bytes], status: str = "completed") -> None:
        self._marker = self._prefix = None
        super()._close(out, status)
