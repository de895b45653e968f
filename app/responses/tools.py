"""Function tools for the chat body: ``function`` tools as chat functions (``strict`` kept),
``namespace`` tools (Codex CLI groups some of its functions so) flattened to functions named
``namespace.name``, named back on the way out (``Translated.names``, ``response.call_item``);
``tool_choice`` (auto / none / required / one function by name). Hosted tools (``HOSTED_TOOLS``:
web search, file search, code interpreter, computer use, image generation, MCP, shells, patches)
are refused with a 400 naming the type: nothing here runs them, and a model offered a tool it
cannot call would answer differently. ``custom`` (free-form) tools become a function with one
string parameter, ``input`` (``app.responses.custom``), named in ``custom`` so the call goes back
out as a ``custom_tool_call``.
"""

from __future__ import annotations

from typing import Any

from app.errors import InvalidRequest
from app.responses.custom import custom_function
from app.responses.names import Names


def _fail(message: str, param: str | None = None) -> InvalidRequest:
    return InvalidRequest(message, param=param)


HOSTED_TOOLS = Names(
    {
        "web_search",
        "web_search_preview",
        "web_search_2025_08_26",
        "web_search_preview_2025_03_11",
        "file_search",
        "code_interpreter",
        "computer_use_preview",
        "computer_use",
        "computer",
        "image_generation",
        "mcp",
        "local_shell",
        "shell",
        "apply_patch",
        "tool_search",
    }
)


def flat(name: Any, namespace: Any, where: str) -> str:
    if not isinstance(name, str) or not name:
        raise _fail(f"{where}.name: a non-empty string is required", where)
    if namespace is None:
        return name
    if not isinstance(namespace, str) or not namespace:
        raise _fail(f"{where}.namespace: must be a non-empty string", where)
    return f"{namespace}.{name}"


def _function(tool: dict[str, Any], name: str, where: str) -> dict[str, Any]:
    parameters = tool.get("parameters")
    if parameters is None:
        parameters = {"type": "object", "properties": {}}
    if not isinstance(parameters, dict):
        raise _fail(f"{where}.parameters: must be an object (a JSON schema)", where)
    function: dict[str, Any] = {"name": name, "parameters": parameters}
    if isinstance(tool.get("description"), str):
        function["description"] = tool["description"]
    if isinstance(tool.get("strict"), bool):
        function["strict"] = tool["strict"]
    return {"type": "function", "function": function}


def tools(value: Any, names: dict[str, tuple[str, str]], custom: set[str]) -> list[dict[str, Any]]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise _fail("tools: must be an array", "tools")
    out: list[dict[str, Any]] = []
    for i, tool in enumerate(value):
        where = f"tools.{i}"
        kind = tool.get("type") if isinstance(tool, dict) else None
        if not isinstance(tool, dict):
            raise _fail(f"{where}: must be an object", where)
        if kind == "function":
            out.append(_function(tool, flat(tool.get("name"), None, where), where))
        elif kind == "namespace":
            space = tool.get("name")
            inner = tool.get("tools")
            if not isinstance(space, str) or not space or not isinstance(inner, list):
                raise _fail(f"{where}: a namespace needs a name and an array of tools", where)
            for j, sub in enumerate(inner):
                at = f"{where}.tools.{j}"
                if not isinstance(sub, dict) or sub.get("type") != "function":
                    raise _fail(f"{at}: only function tools may be in a namespace", at)
                name = flat(sub.get("name"), space, at)
                names[name] = (space, sub["name"])
                out.append(_function(sub, name, at))
        elif kind == "custom":
            name = flat(tool.get("name"), None, where)
            custom.add(name)
            out.append(custom_function(tool, name, where))
        elif kind in HOSTED_TOOLS:
            raise _fail(
                f"{where}.type: {kind!r} is a hosted tool, which this gateway cannot run; "
                'offer function tools only (Codex CLI: set web_search = "disabled")',
                where,
            )
        else:
            raise _fail(f"{where}.type: {str(kind)[:64]!r} tools are not supported here", where)
    return out


def echo_tools(value: Any) -> list[Any]:
    """The tools as the Response object lists them (namespace tools as the client sent them)."""
    return list(value) if isinstance(value, list) else []


def tool_choice(
    choice: Any,
    tools: list[dict[str, Any]],
    chat: dict[str, Any],
    echo: dict[str, Any],
    custom: set[str] | frozenset[str] = frozenset(),
) -> None:
    """``chat``'s ``tool_choice`` for ``choice`` (``tools``: the chat functions, ``custom``: the
    names of those that are custom tools)."""
    echo["tool_choice"] = "auto"
    if choice is None:
        return
    if choice in ("auto", "none", "required"):
        if choice == "required" and not tools:
            raise _fail('tool_choice: "required" needs at least one tool', "tool_choice")
        if tools or choice == "none":
            chat["tool_choice"] = choice
        echo["tool_choice"] = choice
        return
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind not in ("function", "custom") or not isinstance(choice, dict):
        shown = str(kind if kind is not None else choice)[:64]
        raise _fail(f"tool_choice: {shown!r} is not supported here", "tool_choice")
    name = flat(choice.get("name"), choice.get("namespace"), "tool_choice")
    named = {tool["function"]["name"] for tool in tools}
    if name not in (custom if kind == "custom" else named - custom):
        raise _fail(f"tool_choice.name: no {kind} tool named {name[:64]!r}", "tool_choice")
    chat["tool_choice"] = {"type": "function", "function": {"name": name}}
    echo["tool_choice"] = choice
