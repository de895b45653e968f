"""The model names a client may send: a served model, or an alias of one (``model_aliases``).

An alias is a name (``kimi-k2.5``) or a prefix pattern ending in ``*`` (``claude-*``: every name
that starts with ``claude-``). A name resolves to its exact alias first, then to the longest
matching pattern; a name no alias matches stays itself (it may be a served model).

``unknown_model`` is the one message every surface answers an unknown model with: the name sent,
then the names that would have worked, so the client's user sees what to set.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

WILDCARD = "*"
_LISTED = 8  # names shown in an unknown model's message; more are counted
_NAME_CAP = 80  # characters of a client's model name repeated in a message


def is_pattern(alias: str) -> bool:
    return alias.endswith(WILDCARD)


def check_alias(alias: str) -> None:
    """``ValueError`` for an alias no name could match as meant: ``*`` other than at its end, or
    a bare ``*`` (every unknown name, typos included, silently served)."""
    if WILDCARD in alias[:-1]:
        raise ValueError(f"model alias {alias!r}: '*' may only end a pattern, as in claude-*")
    if alias == WILDCARD:
        raise ValueError("model alias '*' would serve every name: give a prefix, as in claude-*")


def resolve(aliases: Mapping[str, str], name: str) -> str:
    """The served model ``name`` stands for (``name`` itself when no alias matches)."""
    target = aliases.get(name)
    if target is not None:
        return target
    best = ""
    for alias in aliases:
        if alias.endswith(WILDCARD) and len(alias) > len(best) and name.startswith(alias[:-1]):
            best = alias
    return aliases[best] if best else name


def usable(served: Iterable[str], aliases: Mapping[str, str]) -> list[str]:
    """The names a request may use now: the served models, then each alias of one."""
    models = list(served)
    return [*models, *(a for a, t in aliases.items() if t in models and a not in models)]


def shown(name: str) -> str:
    """A client's name as a message repeats it: capped, printable."""
    clipped = name[:_NAME_CAP] + ("..." if len(name) > _NAME_CAP else "")
    return clipped.encode("unicode_escape").decode("ascii")


def unknown_model(
    name: str, served: Iterable[str], aliases: Mapping[str, str], hint: str = ""
) -> str:
    """An unknown model's message: what was asked for, what is served, and ``hint`` (what the
    client's own setting for the model is called, where the surface knows it)."""
    names = usable(served, aliases)
    listed = ", ".join(names[:_LISTED])
    if len(names) > _LISTED:
        listed += f" and {len(names) - _LISTED} more"
    text = f"The model `{shown(name)}` does not exist. Use one of: {listed} (GET /v1/models)."
    return f"{text} {hint}" if hint else text
