"""A worker's chat stream, event by event, as Anthropic's Messages stream.

``MessagesStream`` has the relay's observer shape (``app.proxy.surface.Observer``): ``feed``
takes the worker's bytes and returns the client's. Its grammar::

    message_start
    ( content_block_start  content_block_delta*  content_block_stop )*
    message_delta          (stop_reason, stop_sequence, usage)
    message_stop

with ``event: ping`` wherever the gateway's keep-alive falls (``app.anthropic.shape``). One
block is open at a time: ``thinking`` (``thinking_delta`` from ``reasoning_content``, or vLLM's
``reasoning``; none when the client asked for the thinking to be omitted: the block stays
empty), ``text``
(``text_delta`` from ``content``) or ``tool_use`` (opened by a tool call's id or name, its
arguments as ``input_json_delta``); a change of kind closes the open block. The worker's first
chat chunk becomes ``message_start`` (the commit point); its usage chunk (the gateway always
asks for one) gives ``message_delta`` its counts and the acceptance-length estimate its steps
(one per data event, less the role and finish chunks: ``app.upstream.sse``); its ``[DONE]``
ends the message, and nothing the worker sends after it is read. A worker's error event before
the first chunk is raised (the attempt may be retried); after it, it becomes Anthropic's
``event: error`` and nothing follows.

The worker's chunks are checked before translation: the first must carry the attempt's rid as
its ``id`` (``app.upstream.sse.answers``, when ``expect`` is set), and every chunk must have the
chat-chunk shape where it is read (``choices`` an array of objects, ``delta`` an object, text
fields strings, ``tool_calls`` an array of objects with an object ``function``). Any other
chunk is a broken worker's: ``UpstreamBadResponse`` (before the first event: retried on another
worker; after it: Anthropic's in-band ``event: error``), the worker's breaker told either way.

Cost per chunk: the common worker event (one text or reasoning delta of the open block's kind,
in one of SGLang's layouts) is not parsed whole (``_quick``): it is its block's learnt head, one
JSON string literal and its learnt tail, and only the literal is decoded (one small orjson call,
checked to be exactly one string) and written into a delta event prepared when the block
opened. A head is learnt (``_learn``) from an event that was parsed whole and was such a delta:
the same event with a probe string in place of its literal is parsed too, and must give the
probe as the block's text and nothing else (no other text, tool call or finish), so any event
with that head reads as the old parse would read it. An empty literal, and anything else, is
parsed whole (``_data``); ``tests/anthropic/test_stream_golden.py`` pins the bytes either way.
"""

from __future__ import annotations

from typing import Any

import orjson

from app.anthropic.response import message_id, stop_reason, usage_of
from app.anthropic.shape import ANTHROPIC
from app.errors import UpstreamBadResponse
from app.upstream.sse import StreamState, answers, foreign, leading_error
from app.upstream.usage import ACCEPT_LENGTH_FIELD, parse_usage

_OVERHEAD = 2  # the role chunk and the finish chunk carry no verify step


def _malformed(where: str) -> UpstreamBadResponse:
    return UpstreamBadResponse(f"the worker sent a chat chunk with a malformed {where}")


def _event(name: bytes, data: dict[str, Any]) -> bytes:
    return b"event: " + name + b"\ndata: " + orjson.dumps(data) + b"\n\n"


_STOP_BLOCK = b'event: content_block_stop\ndata: {"type":"content_block_stop","index":%d}\n\n'
_MESSAGE_STOP = b'event: message_stop\ndata: {"type":"message_stop"}\n\n'
# A delta event up to its value: index, delta type, field name (the common event, built without
# a dict: only the value is serialised).
_DELTA = (
    b'event: content_block_delta\ndata: {"type":"content_block_delta","index":%d,'
    b'"delta":{"type":"%s","%s":'
)
# A probe for the literal of an event ``_learn`` looks at.
_PROBE = b'"\\u0001"'
# The delta field a block's text comes from, by the block's kind (``_learn``).
_FIELDS = {"thinking": b'"reasoning_content":', "text": b'"content":'}
_THINKING = (b"thinking_delta", b"thinking")
_TEXT = (b"text_delta", b"text")
_JSON = (b"input_json_delta", b"partial_json")


class MessagesStream(StreamState):
    __slots__ = (
        "_block",
        "_expose",
        "_failed",
        "_finish",
        "_heads",
        "_index",
        "_matched",
        "_model",
        "_omit",
        "_out",
        "_raw_usage",
        "_steps",
        "_tool",
    )

    def __init__(self, model: str, *, expose: bool = False, omit_thinking: bool = False) -> None:
        super().__init__()
        self._model = model  # the name the client asked for
        self._expose = expose  # add the estimated acceptance length to the final usage
        self._omit = omit_thinking  # thinking blocks without their text (display: omitted)
        self._block: str | None = None  # the open content block's kind
        self._index = -1  # the open (or last) content block's index
        self._tool: Any = None  # the worker's index of the tool call in the open block
        self._finish: Any = None
        self._matched: Any = None
        self._raw_usage: Any = None
        self._steps = 0  # chat data events with choices
        self._failed = False
        # The common delta event's bytes up to its literal, by block kind (``_learn``).
        self._heads: dict[str, tuple[bytes, bytes]] = {}  # and after it
        self._out: bytes | None = None  # the open block's delta event up to its value

    def feed(self, chunk: bytes) -> bytes:
        framed = self._framed(chunk)
        if framed is None:
            return b""
        chunk, end = framed
        out: list[bytes] = []
        for event in chunk[:end].split(b"\n\n"):
            if self.done:  # the worker's stream has ended: nothing after it is the client's
                self.after_done = self.after_done or bool(event.strip())
                continue
            quick = self._quick(event)
            if quick is not None:
                out.append(quick)
                continue
            at = event.find(b"data:")
            if at >= 0 and self._data(event[at + 5 :].strip(), out):
                self._learn(event)
        if self.done and self._carry:
            self.after_done = self.after_done or bool(self._carry.strip())
            self._carry = b""
        return b"".join(out)

    def finish(self) -> bytes:
        """A last ``data: [DONE]`` without its blank line still ends the message."""
        rest, self._carry = self._carry.strip(), b""
        out: list[bytes] = []
        if rest.startswith(b"data:") and rest[5:].strip() == b"[DONE]":
            self._data(b"[DONE]", out)
        return b"".join(out)

    def _quick(self, event: bytes) -> bytes | None:
        """The open block's common delta, its literal alone decoded; None: parse it whole."""
        kind = self._block
        learnt = self._heads.get(kind) if kind is not None else None
        if learnt is None:
            return None
        head, tail = learnt
        end = len(event) - len(tail)
        if end <= len(head) or not event.endswith(tail) or not event.startswith(head):
            return None
        literal = event[len(head) : end]
        try:
            text = orjson.loads(literal)
        except orjson.JSONDecodeError:
            return None
        if text.__class__ is not str or not text or self._failed or self.done:
            return None
        self.events += 1
        self._steps += 1
        if kind == "thinking" and self._omit:
            return b""
        start = self._out
        if start is None:  # a block opens with a delta written (``_data``): never here
            start = self._out = _DELTA % (self._index, *(_TEXT if kind == "text" else _THINKING))
        # Written as the whole parse would re-serialise it: a literal without escapes is that.
        value = orjson.dumps(text) if b"\\" in literal else literal
        return start + value + b"}}\n\n"

    def _learn(self, event: bytes) -> None:
        """Learns the open block's head from ``event``, a delta of that block's kind parsed whole,
        when the event with a probe for its literal reads as that block's text and nothing else."""
        kind = self._block
        if kind not in _FIELDS or kind in self._heads:
            return
        marker = _FIELDS[kind] + b'"'  # the field, its value a string
        at = event.find(marker)
        if at < 0:
            return
        start = at + len(marker) - 1  # the literal's opening quote
        close = event.find(b'"', start + 1)
        while close > 0 and (close - len(event[:close].rstrip(b"\\"))) % 2:
            close = event.find(b'"', close + 1)  # an escaped quote: inside the literal
        if close < 0:
            return
        head, tail = event[:start], event[close + 1 :]
        probe = head + _PROBE + tail
        try:
            obj = orjson.loads(probe[probe.find(b"data:") + 5 :].strip())
            choices = obj["choices"]
            choice: Any = choices[0] if isinstance(choices, list) else None
            delta = choice["delta"] if isinstance(choice, dict) else None
        except (orjson.JSONDecodeError, KeyError, IndexError, TypeError):
            return
        if not isinstance(delta, dict) or choice.get("finish_reason") is not None:
            return
        reasoning = delta.get("reasoning_content") or delta.get("reasoning")
        text = delta.get("content")
        want = (reasoning, text) == ("\x01", None) or (reasoning, text) == ("\x01", "")
        if kind == "text":
            want = reasoning is None and text == "\x01"
        if want and not delta.get("tool_calls") and "error" not in obj:
            self._heads[kind] = (head, tail)

    def _data(self, payload: bytes, out: list[bytes]) -> bool:
        """Translates one worker event; True when it was a delta of the open block's kind."""
        self.events += 1
        if payload == b"[DONE]":
            self.done = True
            if not self._failed and self.first_data:
                self._end(out)
            return False
        if self._failed:
            return False
        try:
            obj = orjson.loads(payload)
        except orjson.JSONDecodeError:
            return False  # not an event a client could use
        if not isinstance(obj, dict):
            return False
        if "error" in obj and "choices" not in obj:
            if not self.first_data:
                raise leading_error(payload)
            self._failed = self.inband_error = True
            self._close(out)
            out.append(ANTHROPIC.error_events(leading_error(payload)))
            return False
        choices = obj.get("choices")
        choice: Any = None
        if choices:
            choice = choices[0] if isinstance(choices, list) else None
            if not isinstance(choice, dict):
                raise _malformed("choices")
        if not self.first_data:
            rid = self.expect
            if rid is not None and not answers(rid, obj.get("id")):
                raise foreign(rid, obj.get("id"))
            self.first_data = True
            out.append(self._start(obj))
        if choice is None:
            if obj.get("usage") is not None:
                self._raw_usage = obj["usage"]
                self.usage = parse_usage(obj)
                if self.usage is not None:
                    steps = self._steps - _OVERHEAD
                    self.usage.verify_steps = steps if steps > 0 else None
            return False
        self._steps += 1
        delta = choice.get("delta") or {}
        if not isinstance(delta, dict):
            raise _malformed("delta")
        # SGLang's reasoning_content; vLLM's reasoning (newer) or both (the same text).
        reasoning = delta.get("reasoning_content") or delta.get("reasoning")
        text = delta.get("content")
        calls = delta.get("tool_calls") or []
        if not isinstance(reasoning, str | None) or not isinstance(text, str | None):
            raise _malformed("delta text")
        if not isinstance(calls, list):
            raise _malformed("tool_calls")
        if reasoning:
            self._open("thinking", out)
            if not self._omit:
                out.append(self._delta(_THINKING, reasoning))
        if text:
            self._open("text", out)
            out.append(self._delta(_TEXT, text))
        for call in calls:
            self._tool_call(call, out)
        if choice.get("finish_reason") is not None:
            self._finish = choice["finish_reason"]
            # SGLang's matched_stop; vLLM's stop_reason (the matched stop string, or None).
            self._matched = choice.get("matched_stop", choice.get("stop_reason"))
            return False
        return not calls and bool(reasoning) != bool(text)

    def _start(self, obj: dict[str, Any]) -> bytes:
        message: dict[str, Any] = {
            "id": message_id(obj.get("id")),
            "type": "message",
            "role": "assistant",
            "model": self._model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": usage_of(obj.get("usage")),
        }
        return _event(b"message_start", {"type": "message_start", "message": message})

    def _delta(self, kind: tuple[bytes, bytes], value: Any) -> bytes:
        if self._out is None:
            self._out = _DELTA % (self._index, *kind)
        return self._out + orjson.dumps(value) + b"}}\n\n"

    def _open(self, kind: str, out: list[bytes], block: dict[str, Any] | None = None) -> None:
        if self._block == kind and block is None:
            return
        self._close(out)
        self._block = kind
        self._out = None
        self._index += 1
        if block is None:
            block = (
                {"type": "thinking", "thinking": "", "signature": ""}
                if kind == "thinking"
                else {"type": "text", "text": ""}
            )
        start = {"type": "content_block_start", "index": self._index, "content_block": block}
        out.append(_event(b"content_block_start", start))

    def _close(self, out: list[bytes]) -> None:
        if self._block is not None:
            out.append(_STOP_BLOCK % self._index)
            self._block = None

    def _tool_call(self, call: Any, out: list[bytes]) -> None:
        if not isinstance(call, dict):
            raise _malformed("tool_calls")
        function = call.get("function") or {}
        if not isinstance(function, dict):
            raise _malformed("tool_calls")
        call_id, name = call.get("id"), function.get("name")
        arguments = function.get("arguments")
        if not all(isinstance(v, str | None) for v in (call_id, name, arguments)):
            raise _malformed("tool_calls")
        index = call.get("index")
        if call_id or name or self._block != "tool" or index != self._tool:
            block: dict[str, Any] = {
                "type": "tool_use",
                "id": call_id or "",
                "name": name or "",
                "input": {},
            }
            self._open("tool", out, block)
            self._tool = index
        if arguments:
            out.append(self._delta(_JSON, arguments))

    def _end(self, out: list[bytes]) -> None:
        self._close(out)
        reason, sequence = stop_reason(self._finish, self._matched)
        usage: dict[str, Any] = usage_of(self._raw_usage)
        length = self.usage.accept_length if self.usage is not None else None
        if self._expose and length is not None:
            usage[ACCEPT_LENGTH_FIELD] = round(length, 4)
        delta = {"stop_reason": reason, "stop_sequence": sequence}
        data = {"type": "message_delta", "delta": delta, "usage": usage}
        out.append(_event(b"message_delta", data))
        out.append(_MESSAGE_STOP)
