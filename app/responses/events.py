"""The Responses API's stream events, written: sequence numbers, the output items' lifecycle.

``EventWriter`` is what ``app.responses.stream.ResponsesStream`` writes with. Every event has its
``event:`` line and a ``sequence_number`` counting from 0; the grammar::

    response.created  response.in_progress
    ( response.output_item.added
        reasoning:  (response.reasoning_summary_part.added  response.reasoning_summary_text.delta*
                     response.reasoning_summary_text.done  response.reasoning_summary_part.done)
                  | (response.content_part.added  response.reasoning_text.delta*
                     response.reasoning_text.done  response.content_part.done)
        message:    response.content_part.added  response.output_text.delta*
                    response.output_text.done  response.content_part.done
        function_call: response.function_call_arguments.delta*
                       response.function_call_arguments.done
        custom_tool_call: response.custom_tool_call_input.delta*
                          response.custom_tool_call_input.done
      response.output_item.done )*

One output item is open at a time: ``reasoning`` (summary events when the request asked for a
reasoning summary, which is what Codex CLI renders, else reasoning-text events), ``message`` or
``function_call`` (opened by a tool call's id or name, its arguments as deltas); a change of kind
closes the open item. A custom tool's call (``custom_tool_call``) is the call of its function,
whose arguments are JSON holding the input: its input goes out decoded as it arrives, what could
not be decoded so when the call ends (``app.responses.custom.InputStream``). A delta event is the
open item's prepared head (``_head``), the delta as a JSON string literal and its sequence
number, so a literal cut from the worker's event can be written as it is.
"""

from __future__ import annotations

from typing import Any

import orjson

from app.responses.custom import InputStream
from app.responses.response import (
    Context,
    call_item,
    finish,
    frame,
    message_item,
    output_text,
    reasoning_item,
    usage_of,
)
from app.upstream.sse import StreamState
from app.upstream.usage import ACCEPT_LENGTH_FIELD

SEQ = b',"sequence_number":'
END = b"}\n\n"


class EventWriter(StreamState):
    """The events of one response, the open item's state and the closed items."""

    __slots__ = (
        "_ctx",
        "_custom",
        "_expose",
        "_finish",
        "_finished",
        "_head",
        "_item",
        "_kind",
        "_output",
        "_pieces",
        "_raw_usage",
        "_seq",
        "_tool",
    )

    def __init__(self, ctx: Context, *, expose: bool = False) -> None:
        super().__init__()
        self._ctx = ctx
        self._expose = expose  # add the estimated acceptance length to the final usage
        self._seq = 0  # the next event's sequence_number
        self._output: list[dict[str, Any]] = []  # the closed items
        self._kind: str | None = None  # the open item's kind
        self._item: dict[str, Any] = {}  # the open item (as output_item.added showed it)
        self._pieces: list[str] = []  # the open item's text or arguments so far
        self._head = b""  # the open item's delta event, up to its delta value
        self._tool: Any = None  # the worker's index of the open tool call
        self._custom = InputStream()  # the open custom tool call's input
        self._finish: Any = None  # the worker's finish_reason
        self._raw_usage: Any = None  # the worker's usage object
        self._finished = False  # the terminal event went out

    def _event(self, data: dict[str, Any]) -> bytes:
        data["sequence_number"] = self._seq
        self._seq += 1
        kind: bytes = data["type"].encode()
        return b"event: " + kind + b"\ndata: " + orjson.dumps(data) + b"\n\n"

    def _delta(self, value: str, literal: bytes | None = None) -> bytes:
        """The open item's delta event for ``value`` (``literal``: it as a JSON string)."""
        seq = self._seq
        self._seq += 1
        self._pieces.append(value)
        if literal is None:
            literal = orjson.dumps(value)
        return self._head + literal + SEQ + b"%d" % seq + END

    def _response(self, status: str) -> dict[str, Any]:
        response = frame(self._ctx, status)
        response["output"] = list(self._output)
        return response

    def _begin(self, out: list[bytes]) -> None:
        self.first_data = True
        response = orjson.dumps(self._response("in_progress"))  # once for both events
        for kind in (b"response.created", b"response.in_progress"):
            seq = self._seq
            self._seq = seq + 1
            out.append(
                b'event: %s\ndata: {"type":"%s","response":%s,"sequence_number":%d}\n\n'
                % (kind, kind, response, seq)
            )

    def _open(self, kind: str, item: dict[str, Any], out: list[bytes]) -> None:
        self._close(out)
        self._kind, self._item, self._pieces = kind, item, []
        index = len(self._output)
        added = {"type": "response.output_item.added", "output_index": index, "item": item}
        out.append(self._event(added))

    def _head_for(self, kind: str, extra: str) -> bytes:
        return (
            b"event: %s\ndata: {\"type\":\"%s\",\"item_id\":\"%s\",\"output_index\":%d%s,"
            b'"delta":'
            % (kind.encode(), kind.encode(), self._item["id"].encode(), len(self._output),
               extra.encode())
        )  # fmt: skip

    def _reasoning(self, text: str, out: list[bytes], literal: bytes | None = None) -> None:
        if self._kind != "reasoning":
            self._close(out)
            index = len(self._output)
            item = reasoning_item(self._ctx, index, "", "in_progress")
            item["summary"] = []
            item.pop("content", None)
            self._open("reasoning", item, out)
            common = {"item_id": item["id"], "output_index": index}
            if self._ctx.summary:
                part = {"type": "summary_text", "text": ""}
                added = {"type": "response.reasoning_summary_part.added", **common}
                out.append(self._event({**added, "summary_index": 0, "part": part}))
                self._head = self._head_for(
                    "response.reasoning_summary_text.delta", ',"summary_index":0'
                )
            else:
                part = {"type": "reasoning_text", "text": ""}
                added = {"type": "response.content_part.added", **common}
                out.append(self._event({**added, "content_index": 0, "part": part}))
                self._head = self._head_for("response.reasoning_text.delta", ',"content_index":0')
        out.append(self._delta(text, literal))

    def _text(self, text: str, out: list[bytes], literal: bytes | None = None) -> None:
        if self._kind != "message":
            self._close(out)
            index = len(self._output)
            item = message_item(self._ctx, index, "", "in_progress")
            self._open("message", item, out)
            common = {"item_id": item["id"], "output_index": index, "content_index": 0}
            part = output_text("")
            out.append(self._event({"type": "response.content_part.added", **common, "part": part}))
            self._head = self._head_for(
                "response.output_text.delta", ',"content_index":0,"logprobs":[]'
            )
        out.append(self._delta(text, literal))

    def _call(self, call: tuple[Any, str | None, str | None, str | None], out: list[bytes]) -> None:
        index, call_id, name, arguments = call
        if call_id or name or self._kind != "call" or index != self._tool:
            self._close(out)
            item = call_item(
                self._ctx, len(self._output), call_id or "", name or "", "", "in_progress"
            )
            self._open("call", item, out)
            self._tool = index
            if item["type"] == "custom_tool_call":
                self._custom = InputStream()
                self._head = self._head_for("response.custom_tool_call_input.delta", "")
            else:
                self._head = self._head_for("response.function_call_arguments.delta", "")
        if arguments:
            if self._item["type"] == "custom_tool_call":
                arguments = self._custom.feed(arguments)
            if arguments:
                out.append(self._delta(arguments))

    def _close(self, out: list[bytes], status: str = "completed") -> None:
        kind = self._kind
        if kind is None:
            return
        self._kind = None
        item, text = self._item, "".join(self._pieces)
        index = len(self._output)
        common = {"item_id": item["id"], "output_index": index}
        if kind == "reasoning":
            done = reasoning_item(self._ctx, index, text, status)
            if self._ctx.summary:
                part = {"type": "summary_text", "text": text}
                out.append(
                    self._event(
                        {"type": "response.reasoning_summary_text.done", **common}
                        | {"summary_index": 0, "text": text}
                    )
                )
                out.append(
                    self._event(
                        {"type": "response.reasoning_summary_part.done", **common}
                        | {"summary_index": 0, "part": part}
                    )
                )
            else:
                part = {"type": "reasoning_text", "text": text}
                common["content_index"] = 0
                out.append(
                    self._event({"type": "response.reasoning_text.done", **common, "text": text})
                )
                out.append(
                    self._event({"type": "response.content_part.done", **common, "part": part})
                )
        elif kind == "message":
            done = message_item(self._ctx, index, text, status)
            common["content_index"] = 0
            out.append(
                self._event(
                    {"type": "response.output_text.done", **common, "text": text, "logprobs": []}
                )
            )
            part = output_text(text)
            out.append(self._event({"type": "response.content_part.done", **common, "part": part}))
        elif item["type"] == "custom_tool_call":
            rest, whole = self._custom.close()
            if rest:
                out.append(self._delta(rest))
            done = dict(item, input=whole, status=status)
            input_done = {"type": "response.custom_tool_call_input.done", **common}
            out.append(self._event(input_done | {"input": whole}))
        else:
            done = dict(item, arguments=text, status=status)
            out.append(
                self._event(
                    {"type": "response.function_call_arguments.done", **common}
                    | {"name": item["name"], "arguments": text}
                )
            )
        self._output.append(done)
        out.append(
            self._event({"type": "response.output_item.done", "output_index": index, "item": done})
        )

    def _end(self, out: list[bytes]) -> None:
        incomplete = self._finish == "length"
        self._close(out, "incomplete" if incomplete else "completed")
        self._finished = True
        response = self._response("completed")
        finish(response, self._finish)
        usage = usage_of(self._raw_usage)
        length = self.usage.accept_length if self.usage is not None else None
        if usage is not None and self._expose and length is not None:
            usage[ACCEPT_LENGTH_FIELD] = round(length, 4)
        response["usage"] = usage
        kind = "response.incomplete" if incomplete else "response.completed"
        if self._ctx.on_final is not None:
            self._ctx.on_final(response)
        out.append(self._event({"type": kind, "response": response}))
