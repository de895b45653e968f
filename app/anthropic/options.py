"""A Messages request's other fields as the chat body's (see ``app.anthropic.request``):
sampling, tools and ``tool_choice``, ``thinking``, the output format, ``context_management``.
"""

from __future__ import annotations

from typing import Any

from app.errors import InvalidRequest
from app.proxy.metadata import check_metadata

CLEAR_THINKING = "clear_thinking_20251015"


def _fail(message: str, param: str | None = None) -> InvalidRequest:
    return InvalidRequest(message, param=param)


def sampling(body: dict[str, Any], chat: dict[str, Any]) -> None:
    stops = body.get("stop_sequences")
    if stops is not None:
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise _fail("stop_sequences: must be an array of strings", "stop_sequences")
        if stops:
            chat["stop"] = stops
    for name in ("temperature", "top_p"):
        value = body.get(name)
        if value is None:
            continue
        if not isinstance(value, int | float) or isinstance(value, bool):
            raise _fail(f"{name}: must be a number", name)
        chat[name] = value
    top_k = body.get("top_k")
    if top_k is not None:
        if not isinstance(top_k, int) or isinstance(top_k, bool):
            raise _fail("top_k: must be an integer", "top_k")
        chat["top_k"] = top_k
    metadata = body.get("metadata")
    check_metadata(metadata, nulls=True)
    if isinstance(metadata, dict) and isinstance(metadata.get("user_id"), str):
        chat["user"] = metadata["user_id"]


def tools(body: dict[str, Any], chat: dict[str, Any]) -> None:
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise _fail("tools: must be an array", "tools")
    functions: list[dict[str, Any]] = []
    for i, tool in enumerate(tools or ()):
        if not isinstance(tool, dict) or not isinstance(tool.get("name"), str):
            raise _fail(f"tools.{i}: a tool needs a string name", f"tools.{i}")
        schema = tool.get("input_schema")
        if schema is None and tool.get("type") not in (None, "custom"):
            continue  # a server tool (web search, bash...): Anthropic runs those, not the model
        if not isinstance(schema, dict):
            raise _fail(f"tools.{i}.input_schema: an object is required", f"tools.{i}")
        function: dict[str, Any] = {"name": tool["name"], "parameters": schema}
        if isinstance(tool.get("description"), str):
            function["description"] = tool["description"]
        functions.append({"type": "function", "function": function})
    if functions:
        chat["tools"] = functions
    choice = body.get("tool_choice")
    if choice is None:
        return
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind == "none":
        chat["tool_choice"] = "none"
        return
    if not isinstance(choice, dict) or kind not in ("auto", "any", "tool"):
        raise _fail("tool_choice.type: must be auto, any, tool or none", "tool_choice")
    if not functions:
        if kind == "auto":
            return
        raise _fail(f"tool_choice: {kind!r} needs at least one tool", "tool_choice")
    if kind == "tool":
        name = choice.get("name")
        if not isinstance(name, str):
            raise _fail("tool_choice.name: a string is required", "tool_choice.name")
        if name not in {f["function"]["name"] for f in functions}:
            raise _fail(f"tool_choice.name: no tool named {name[:100]!r}", "tool_choice.name")
        chat["tool_choice"] = {"type": "function", "function": {"name": name}}
    else:
        chat["tool_choice"] = "required" if kind == "any" else "auto"
    if choice.get("disable_parallel_tool_use") is True:
        chat["parallel_tool_calls"] = False


_THINKING_TYPES = ("enabled", "disabled", "adaptive")


def thinking(thinking: Any, chat: dict[str, Any]) -> bool:
    """Sets Kimi's thinking switch; True when the client asked for the thinking to be omitted."""
    if thinking is None:
        return False
    if not isinstance(thinking, dict) or thinking.get("type") not in _THINKING_TYPES:
        raise _fail("thinking.type: must be enabled, disabled or adaptive", "thinking")
    kind, display = thinking["type"], thinking.get("display")
    if display is not None and not isinstance(display, str):
        raise _fail("thinking.display: must be a string", "thinking")
    chat["chat_template_kwargs"] = {"thinking": kind != "disabled"}
    return display == "omitted"


def output(body: dict[str, Any], chat: dict[str, Any]) -> None:
    """``output_config`` (``effort``: accepted; ``format``) and the older ``output_format``."""
    config = body.get("output_config")
    if config is not None and not isinstance(config, dict):
        raise _fail("output_config: must be an object", "output_config")
    config = config or {}
    effort = config.get("effort")
    if effort is not None and not isinstance(effort, str):
        raise _fail("output_config.effort: must be a string", "output_config")
    unknown = next((name for name in config if name not in ("effort", "format")), None)
    if unknown is not None:
        raise _fail(f"output_config.{unknown}: not supported by this gateway", "output_config")
    fmt = config.get("format", body.get("output_format"))
    if fmt is None:
        return
    where = "output_config" if "format" in config else "output_format"
    kind, schema = (fmt.get("type"), fmt.get("schema")) if isinstance(fmt, dict) else (None, None)
    if kind != "json_schema" or not isinstance(schema, dict):
        raise _fail(f"{where}: a json_schema format with an object schema is required", where)
    chat["response_format"] = {
        "type": "json_schema",
        "json_schema": {"name": "output", "schema": schema, "strict": True},
    }


def context_management(value: Any, out: list[dict[str, Any]]) -> None:
    """Applies ``clear_thinking`` edits to the translated history; refuses any other edit."""
    if value is None:
        return
    edits = value.get("edits") if isinstance(value, dict) else None
    if not isinstance(edits, list):
        raise _fail("context_management.edits: must be an array", "context_management")
    for i, edit in enumerate(edits):
        if not isinstance(edit, dict) or edit.get("type") != CLEAR_THINKING:
            kind = edit.get("type") if isinstance(edit, dict) else None
            raise _fail(
                f"context_management.edits.{i}: this gateway does not support the {kind} "
                "context management strategy",
                "context_management",
            )
        keep = edit.get("keep", {"type": "thinking_turns", "value": 1})
        if keep == "all":
            continue
        turns = keep.get("value") if isinstance(keep, dict) else None
        if not (isinstance(turns, int) and not isinstance(turns, bool) and turns >= 0) or (
            isinstance(keep, dict) and keep.get("type") != "thinking_turns"
        ):
            raise _fail(
                f'context_management.edits.{i}.keep: "all" or thinking_turns is required',
                "context_management",
            )
        thinking = [m for m in out if m["role"] == "assistant" and "reasoning_content" in m]
        for message in thinking[: max(len(thinking) - turns, 0)]:
            del message["reasoning_content"]
