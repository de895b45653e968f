"""The configuration reference (``docs/configuration.md``), rendered from the settings model.

Every setting of ``app.config.Settings``, nested sections included, with its environment variable
(``DFLASH_GATEWAY_`` + the path joined by ``__``), its command-line flag where ``serve`` has one,
its type and bounds (from the field's annotation and constraints), its default and its
description. A setting's description is its ``Field(description=...)`` if it has one, else the
comment lines directly above its declaration, plus a comment at the end of its line: the way the
settings modules document their fields. A section's text is its class docstring. A setting with
no description is an error, so the page documents every setting or is not written.

``python -m app.config_doc`` writes the page (``make docs-config``); ``--check`` exits 1 when the
committed page differs from what the model renders (``tests/docs/test_config_doc.py`` asserts the
same), so the reference cannot drift from the code.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import io
import json
import re
import sys
import tokenize
import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import annotated_types
from pydantic import BaseModel, SecretStr
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined
from pydantic_settings import NoDecode

from app.config import ENV_PREFIX, Settings

PAGE = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"

# Defaults computed from the environment at start-up: shown as text, not as this machine's value.
COMPUTED_DEFAULTS = {
    "discovery.api_url": "in a pod, the cluster's API server (`KUBERNETES_SERVICE_HOST`); "
    "else unset"
}
# Flags of `dflash-gateway serve` whose destination is not the setting's own name.
FLAG_SETTINGS = {
    "api_key_file": "auth.keys_file",
    "pd_disaggregation": "pd.disaggregation",
    "prefill": "pd.prefill",
    "decode": "pd.decode",
    "prefill_policy": "pd.prefill_policy",
    "decode_policy": "pd.decode_policy",
}
# The page that explains a section in depth (relative to docs/).
SEE_ALSO = {
    "": "getting-started.md",
    "health": "routing.md",
    "breaker": "routing.md",
    "retry": "routing.md",
    "admission": "routing.md",
    "timeouts": "security.md",
    "limits": "security.md",
    "auth": "security.md",
    "discovery": "routing.md",
    "embedded": "emulator.md",
    "routing": "routing.md",
    "tenants": "tenants.md",
    "tracing": "tenants.md#traces-opentelemetry",
    "workers": "tenants.md#priority-classes-and-fair-sharing-between-api-keys",
    "pd": "pd.md",
}

HEADER = """\
# Configuration reference

<!-- Generated from the settings model (app/config.py) by `make docs-config`
     (python -m app.config_doc). Do not edit: change the model, then regenerate. -->

Every setting can come from a command-line flag of `dflash-gateway serve`, an environment
variable, or a YAML/TOML file named by `--config` (or `DFLASH_GATEWAY_CONFIG_FILE`), in that
order of priority; what none of them sets keeps its default. Settings are validated once, at
start-up: a bad value stops the gateway with a message naming the setting and its variable.

- **Environment**: `DFLASH_GATEWAY_` + the setting's path in capitals, sections joined by `__`
  (`health.interval_s` is `DFLASH_GATEWAY_HEALTH__INTERVAL_S`). Lists are comma-separated
  (`DFLASH_GATEWAY_WORKER_URLS=http://10.0.0.5:30000,http://10.0.0.6:30000`); mappings of
  sections (`tenants.keys`) are JSON.
- **File**: the same keys, nested (`health: {interval_s: 5}`).

```bash
DFLASH_GATEWAY_WORKER_URLS=http://10.0.0.5:30000,http://10.0.0.6:30000 \\
DFLASH_GATEWAY_HEALTH__INTERVAL_S=5 \\
dflash-gateway serve --host 0.0.0.0 --policy prefix_affinity
```

With no worker URL and no discovery configured, `serve` starts the embedded default: two
emulated workers as child processes (`embedded.*`).
"""


class Undocumented(Exception):
    """Settings without a description; the message names each one."""


@dataclass(frozen=True)
class Row:
    path: str
    env: str
    flag: str | None
    type: str
    default: str
    description: str


def render(settings: type[BaseModel] = Settings) -> str:
    """The whole page for ``settings``, as ``docs/configuration.md`` must hold it for Settings.
    Raises ``Undocumented`` naming every setting that has no description."""
    flags = _serve_flags()
    sections: list[tuple[str, str, list[Row]]] = []
    missing: list[str] = []
    general: list[Row] = []
    for name, field in settings.model_fields.items():
        model = _model_of(field.annotation)
        if model is None:
            general.append(_row(settings, name, field, (name,), flags, missing))
        else:
            rows = list(_section_rows(model, (name,), flags, missing))
            sections.append((name, _doc(model), rows))
    if missing:
        raise Undocumented(
            "settings without a description (add a comment above the field, or "
            "Field(description=...)): " + ", ".join(missing)
        )
    parts = [HEADER, _section("General", "", general, SEE_ALSO.get(""))]
    for name, text, rows in sections:
        parts.append(_section(f"`{name}`", text, rows, SEE_ALSO.get(name)))
    return "\n".join(parts)


def _section_rows(
    model: type[BaseModel],
    prefix: tuple[str, ...],
    flags: dict[str, str],
    missing: list[str],
) -> Iterator[Row]:
    for name, field in model.model_fields.items():
        path = (*prefix, name)
        inner = _model_of(field.annotation)
        if inner is not None:
            yield from _section_rows(inner, path, flags, missing)
        else:
            yield _row(model, name, field, path, flags, missing)


def _row(
    owner: type[BaseModel],
    name: str,
    field: FieldInfo,
    path: tuple[str, ...],
    flags: dict[str, str],
    missing: list[str],
) -> Row:
    dotted = ".".join(path)
    description = field.description or _comments(owner).get(name, "")
    if not description:
        missing.append(dotted)
    return Row(
        path=dotted,
        env=ENV_PREFIX + "__".join(p.upper() for p in path),
        flag=flags.get(dotted),
        type=_type(field),
        default=COMPUTED_DEFAULTS.get(dotted) or _default(name, field),
        description=_markdown(description),
    )


def _section(title: str, text: str, rows: list[Row], see: str | None) -> str:
    out = [f"## {title}", ""]
    if text:
        out += [text, ""]
    if see:
        out += [f"More: [{_page_title(see)}]({see}).", ""]
    # Two columns, so the table fits the text column: the names (never broken, by the site's
    # CSS) and what they do, with the type and default under the description.
    out += ["| setting | description, type, default |", "| --- | --- |"]
    for row in rows:
        where = f"`{row.path}`<br>`{row.env}`"
        if row.flag:
            where += f"<br>`{row.flag}`"
        about = f"{_cell(row.description)}<br>*{_cell(row.type)}*; default: {_cell(row.default)}"
        out.append(f"| {where} | {about} |")
    out.append("")
    return "\n".join(out)


def _page_title(link: str) -> str:
    page = link.partition("#")[0].removesuffix(".md")
    return page.replace("-", " ").capitalize()


def _model_of(annotation: Any) -> type[BaseModel] | None:
    return (
        annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None
    )


def _doc(model: type[BaseModel]) -> str:
    doc = model.__doc__
    return _markdown(inspect.cleandoc(doc)) if doc else ""


def _comments(model: type[BaseModel]) -> dict[str, str]:
    """Field name -> the comment lines directly above its declaration in ``model``'s class body,
    then a comment at the end of the declaration's last line."""
    source = inspect.cleandoc("\n" + inspect.getsource(model))  # dedented; line 1 is blank
    lines = source.splitlines()
    whole_line: dict[int, str] = {}
    trailing: dict[int, str] = {}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type != tokenize.COMMENT:
            continue
        row, col = token.start
        text = token.string.lstrip("#").strip()
        if lines[row - 1][:col].strip():
            trailing[row] = text
        else:
            whole_line[row] = text
    [cls] = ast.parse(source).body
    assert isinstance(cls, ast.ClassDef)
    found: dict[str, str] = {}
    for node in cls.body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        above: list[str] = []
        row = node.lineno - 1
        while row in whole_line:
            above.insert(0, whole_line[row])
            row -= 1
        end = trailing.get(node.end_lineno or node.lineno)
        found[node.target.id] = " ".join([*above, *([end] if end else [])])
    return found


def _markdown(text: str) -> str:
    """reStructuredText literals (````x````) as Markdown code; a literal block's ``::`` as ``:``."""
    text = re.sub(r"``(.+?)``", r"`\1`", text).replace("::\n", ":\n")
    return text[:1].upper() + text[1:]


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _type(field: FieldInfo) -> str:
    annotation = field.annotation
    optional = False
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        optional = len(args) < len(typing.get_args(annotation))
        annotation = args[0] if len(args) == 1 else annotation
    text = _type_name(annotation)
    if any(m is NoDecode for m in field.metadata) and text.startswith("list"):
        text += " (comma-separated in the environment)"
    elif any(m is NoDecode for m in field.metadata) and text.startswith("mapping"):
        text += " (`name=value,...` in the environment)"
    bounds = [_bound(m) for m in field.metadata]
    text = ", ".join([text, *(b for b in bounds if b)])
    return f"{text}; or unset" if optional else text


def _type_name(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is Literal:
        return "one of " + ", ".join(f"`{a}`" for a in args)
    if origin in (list, tuple):
        return f"list of {_type_name(args[0])}s"
    if origin is dict:
        value = args[1]
        model = _model_of(value)
        if model is not None:
            fields = ", ".join(model.model_fields)
            return f"mapping of name to {{{fields}}} (JSON in the environment)"
        return f"mapping of {_type_name(args[0])} to {_type_name(value)}"
    names = {
        bool: "boolean",
        int: "integer",
        float: "number",
        str: "string",
        Path: "path",
        SecretStr: "secret string",
    }
    return names.get(annotation, getattr(annotation, "__name__", str(annotation)))


def _bound(meta: Any) -> str | None:
    if isinstance(meta, annotated_types.Ge):
        return f"≥ {meta.ge}"
    if isinstance(meta, annotated_types.Gt):
        return f"> {meta.gt}"
    if isinstance(meta, annotated_types.Le):
        return f"≤ {meta.le}"
    if isinstance(meta, annotated_types.Lt):
        return f"< {meta.lt}"
    if isinstance(meta, annotated_types.MinLen):
        return "not empty" if meta.min_length == 1 else f"at least {meta.min_length} long"
    return None


def _default(name: str, field: FieldInfo) -> str:
    if field.default_factory is not None:
        value = field.default_factory()  # type: ignore[call-arg]
    elif field.default is PydanticUndefined:
        return "required"
    else:
        value = field.default
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, (list, tuple, dict)) and not value:
        return "empty"
    if isinstance(value, dict):
        return ", ".join(f"`{k}={v}`" for k, v in value.items())
    if isinstance(value, BaseModel):
        return f"`{json.dumps(value.model_dump(mode='json'))}`"
    if isinstance(value, int) and name.endswith("_bytes"):
        return f"`{value}` ({_size(value)})"
    return f"`{value}`"


def _size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} bytes"


def _serve_flags() -> dict[str, str]:
    """Setting path -> the ``dflash-gateway serve`` flag that sets it."""
    from app.__main__ import serve_parser

    found: dict[str, str] = {}
    for action in serve_parser()._actions:
        if not action.option_strings or action.dest == "help":
            continue
        path = FLAG_SETTINGS.get(action.dest, action.dest)
        found[path] = max(action.option_strings, key=len)
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m app.config_doc", description=__doc__)
    parser.add_argument("--out", type=Path, default=PAGE, help=f"default {PAGE}")
    parser.add_argument("--check", action="store_true", help="exit 1 if --out is not up to date")
    args = parser.parse_args(argv)
    try:
        page = render()
    except Undocumented as exc:
        print(f"config_doc: {exc}", file=sys.stderr)
        return 1
    if args.check:
        current = args.out.read_text(encoding="utf-8") if args.out.exists() else ""
        if current != page:
            print(f"config_doc: {args.out} is out of date: run `make docs-config`", file=sys.stderr)
            return 1
        return 0
    args.out.write_text(page, encoding="utf-8")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
