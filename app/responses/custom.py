"""Custom (free-form) tools as the worker's chat functions, and their calls back.

A ``custom`` tool (``{"type": "custom", "name", "description", "format"}``) takes free text, not
JSON. The worker serves chat function calling only, so the tool is offered as a function with one
string parameter, ``input`` (``custom_function``); the tool's ``format`` is written into the
function's description: ``text`` (any text, the default) or ``grammar`` (``syntax`` ``lark`` or
``regex`` and its ``definition``). The grammar is advice to the model, not a constraint: the
worker can constrain a whole answer to an EBNF or a regex, never one argument of a tool call, so
an input that does not match it is passed on as the model wrote it.

A call of such a function goes out as a ``custom_tool_call`` with the ``input`` string
(``input_of``: arguments that are not an object with a string ``input`` are passed on as they
are); a ``custom_tool_call`` input item comes back in as the function call (``arguments_of``).
"""

from __future__ import annotations

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


def input_of(arguments: str) -> str:
    """A custom tool's input from the function call's ``arguments``."""
    try:
        value = orjson.loads(arguments)
    except orjson.JSONDecodeError:
        return arguments
    if isinstance(value, dict) and isinstance(value.get(ARGUMENT), str):
        return str(value[ARGUMENT])
    return arguments


def arguments_of(text: str) -> str:
    """The function call's ``arguments`` for a custom tool's input ``text``."""
    return orjson.dumps({ARGUMENT: text}).decode()
