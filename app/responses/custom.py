"""Custom (free-form) tools as the worker's chat functions, and their calls back.

A ``custom`` tool (``{"type": "custom", "name", "description", "format"}``) takes free text, not
JSON. The worker serves chat function calling only, so the tool is offered as a function with one
string parameter, ``input`` (``custom_function``); the tool's ``format`` is written into the
function's description: ``text`` (any text, the default) or ``grammar`` (``syntax`` ``lark`` or
``regex`` and its ``definition``). The grammar is advice to the model, not a constraint: the
worker can constrain a whole answer to an EBNF or a regex, never one argument of a tool call, so
an input that does not match it is passed on as the model wrote it.

A call of such a function goes out as a ``custom_tool_call`` with the ``input`` string
(``input_of``); a ``custom_tool_call`` input item comes back in as the function call
(``arguments_of``). Arguments that are not an object with a string ``input`` but begin as one
(``{"input": "...``, cut short or followed by something else) give the string as far as it
goes; any other arguments are passed on as they are. Streamed, ``InputStream`` decodes the
string as its arguments arrive, so the input streams as the model writes it, and its deltas
always add up to what ``input_of`` makes of the whole arguments (save a JSON object naming
``input`` twice).
"""

from __future__ import annotations

import re
from typing import Any

import orjson

from app.errors import InvalidRequest

ARGUMENT = "input"
_SYNTAXES = ("lark", "regex")


def _fail(message: str, param: str) -> InvalidRequest:
    return InvalidRequest(message, param=param)


def _format_note(fmt: Any, where: str) -> str:
    if fmt is None:
        return ""
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return ""
    if kind != "grammar" or not isinstance(fmt, dict):
        raise _fail(f"{where}.format.type: must be text or grammar", where)
    syntax, definition = fmt.get("syntax"), fmt.get("definition")
    if syntax not in _SYNTAXES:
        raise _fail(f"{where}.format.syntax: must be lark or regex", where)
    if not isinstance(definition, str) or not definition:
        raise _fail(f"{where}.format.definition: a non-empty string is required", where)
    what = "Lark grammar" if syntax == "lark" else "regular expression"
    return f"\n\nThe input must match this {what}:\n{definition}"


def custom_function(tool: dict[str, Any], name: str, where: str) -> dict[str, Any]:
    """The chat function for custom tool ``tool`` (named ``name``)."""
    described = tool.get("description")
    if described is not None and not isinstance(described, str):
        raise _fail(f"{where}.description: must be a string", where)
    note = _format_note(tool.get("format"), where)
    parameter = (
        "The tool's whole input as free-form text (not JSON unless the tool asks for JSON)." + note
    )
    function: dict[str, Any] = {
        "name": name,
        "parameters": {
            "type": "object",
            "properties": {ARGUMENT: {"type": "string", "description": parameter}},
            "required": [ARGUMENT],
            "additionalProperties": False,
        },
    }
    description = (described or "") + note
    if description:
        function["description"] = description.lstrip("\n")
    return {"type": "function", "function": function}


_OPENING = re.compile(r'\s*\{\s*"input"\s*:\s*"')
_OPENING_MAX = 64  # arguments that have not opened so by then never will: passed on whole
_PLAIN = re.compile(r'[^"\\]+')
_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r"}
_ESCAPES["t"] = "\t"
_HEX = frozenset("0123456789abcdefABCDEF")


def _code(text: str, at: int) -> int | None:
    """The code of the ``\\uXXXX`` escape at ``at`` in ``text`` (None: none, or not yet whole)."""
    digits = text[at + 2 : at + 6]
    if text[at : at + 2] != "\\u" or len(digits) < 4 or not _HEX.issuperset(digits):
        return None
    return int(digits, 16)


def _may_begin_escape(tail: str) -> bool:
    """Whether ``tail`` (under six characters) may be the start of a ``\\uXXXX`` escape."""
    return "\\u".startswith(tail[:2]) and _HEX.issuperset(tail[2:])


def _string(text: str, start: int) -> tuple[list[str], int, bool]:
    """The JSON string body at ``start``, decoded as far as it is whole: its pieces, where the
    rest begins, and whether the closing quote was reached. Stops at an escape not yet whole
    (or not valid); a lone surrogate is U+FFFD."""
    out: list[str] = []
    at, end = start, len(text)
    while at < end:
        char = text[at]
        if char == '"':
            return out, at + 1, True
        if char != "\\":
            plain = _PLAIN.match(text, at)
            assert plain is not None
            out.append(plain.group())
            at = plain.end()
            continue
        escape = text[at + 1 : at + 2]
        if escape in _ESCAPES and escape:
            out.append(_ESCAPES[escape])
            at += 2
            continue
        code = _code(text, at)
        if code is None:
            break
        if 0xD800 <= code < 0xDC00:
            tail = text[at + 6 : at + 12]
            if len(tail) < 6 and _may_begin_escape(tail):
                break  # its low half may follow
            low = _code(text, at + 6)
            if low is not None and 0xDC00 <= low < 0xE000:
                out.append(chr(0x10000 + ((code - 0xD800) << 10) + (low - 0xDC00)))
                at += 12
                continue
            code = 0xFFFD
        elif 0xDC00 <= code < 0xE000:
            code = 0xFFFD
        out.append(chr(code))
        at += 6
    return out, at, False


def input_of(arguments: str) -> str:
    """A custom tool's input from the function call's ``arguments``."""
    try:
        value = orjson.loads(arguments)
    except orjson.JSONDecodeError:
        value = None
    if isinstance(value, dict) and isinstance(value.get(ARGUMENT), str):
        return str(value[ARGUMENT])
    opening = _OPENING.match(arguments)
    if opening is None:
        return arguments
    return "".join(_string(arguments, opening.end())[0])


class InputStream:
    """A streamed custom tool call's input, decoded from its arguments as they arrive."""

    __slots__ = ("_at", "_done", "_raw", "_sent")

    def __init__(self) -> None:
        self._raw = ""  # the arguments so far
        self._at: int | None = None  # where the input's undecoded rest begins (None: not open)
        self._done = False  # the string ended, or the arguments never opened as one
        self._sent = 0  # the input's characters given out

    def feed(self, arguments: str) -> str:
        """The input's next whole piece (may be empty)."""
        self._raw += arguments
        if self._done:
            return ""
        if self._at is None:
            opening = _OPENING.match(self._raw)
            if opening is None:
                self._done = len(self._raw) > _OPENING_MAX
                return ""
            self._at = opening.end()
        pieces, self._at, self._done = _string(self._raw, self._at)
        text = "".join(pieces)
        self._sent += len(text)
        return text

    def close(self) -> tuple[str, str]:
        """The input's last piece (what was not given out yet) and the whole input."""
        whole = input_of(self._raw)
        return whole[self._sent :], whole


def arguments_of(text: str) -> str:
    """The function call's ``arguments`` for a custom tool's input ``text``."""
    return orjson.dumps({ARGUMENT: text}).decode()
