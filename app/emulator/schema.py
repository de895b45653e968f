"""Values that satisfy a JSON schema: tool-call arguments and grammar-constrained JSON answers.

Covers what agents and ``response_format`` schemas use: ``type`` (or a list of types),
``properties``/``required`` (every declared property is produced), ``items``/``prefixItems`` with
``minItems``, ``enum``, ``const``, ``anyOf``/``oneOf`` (the first branch), ``allOf`` (merged),
``$ref`` into ``$defs``/``definitions``, numeric ``minimum``/``maximum`` and string
``minLength``/``maxLength``. Words come from the prompt, numbers from the caller's ``random``, so
(prompt, seed) fixes the value.

Every value made and every character of a string spends a unit of a ``Budget``
(``app.emulator.grammar``): ``minItems``/``minLength`` nestings that would expand to millions of
values are a ``GrammarError`` (400) rather than a stalled event loop or an exhausted memory.
"""

from __future__ import annotations

import random
from typing import Any

from app.emulator.grammar import Budget

_MAX_DEPTH = 12


class SchemaValues:
    def __init__(
        self,
        root: dict[str, Any],
        words: list[str],
        rng: random.Random,
        budget: Budget | None = None,
    ) -> None:
        self._root = root
        self._words = words or ["value"]
        self._rng = rng
        self._budget = budget or Budget("json")

    def value(self, schema: Any, depth: int = 0) -> Any:
        self._budget.spend(1)
        if not isinstance(schema, dict) or depth > _MAX_DEPTH:
            return None if depth > _MAX_DEPTH else self._word()
        schema = self._resolve(schema)
        if "const" in schema:
            return schema["const"]
        if isinstance(schema.get("enum"), list) and schema["enum"]:
            return schema["enum"][0]
        for key in ("anyOf", "oneOf"):
            if isinstance(schema.get(key), list) and schema[key]:
                return self.value(schema[key][0], depth + 1)
        if isinstance(schema.get("allOf"), list):
            merged: dict[str, Any] = {k: v for k, v in schema.items() if k != "allOf"}
            for part in schema["allOf"]:
                if isinstance(part, dict):
                    part = self._resolve(part)
                    mine, theirs = merged.get("properties"), part.get("properties")
                    props = {**_mapping(mine), **_mapping(theirs)}
                    merged = {**merged, **part, "properties": props}
                    self._budget.spend(len(merged) + len(props))
            return self.value(merged, depth + 1)
        kind = schema.get("type")
        if isinstance(kind, list):
            kind = next((k for k in kind if k != "null"), kind[0] if kind else None)
        if kind is None:
            kind = "object" if "properties" in schema else "array" if "items" in schema else None
        return self._typed(kind, schema, depth)

    def _typed(self, kind: Any, schema: dict[str, Any], depth: int) -> Any:
        rng = self._rng
        if kind == "object":
            props = schema.get("properties")
            if not isinstance(props, dict):
                return {}
            return {name: self.value(sub, depth + 1) for name, sub in props.items()}
        if kind == "array":
            low = schema.get("minItems", 1)
            count = low if isinstance(low, int) and low > 1 else 1
            high = schema.get("maxItems")
            if isinstance(high, int):
                count = min(count, high)
            prefix = schema.get("prefixItems")
            items: list[Any] = []
            if isinstance(prefix, list):
                items = [self.value(sub, depth + 1) for sub in prefix]
            while len(items) < count:
                items.append(self.value(schema.get("items", {"type": "string"}), depth + 1))
            return items
        if kind in ("integer", "number"):
            low, high = _bounds(schema)
            if kind == "integer":
                return rng.randint(int(low), max(int(low), int(high)))
            return low + (high - low) * rng.randint(1, 99) / 100
        if kind == "boolean":
            return True
        if kind == "null":
            return None
        return self._string(schema)

    def _string(self, schema: dict[str, Any]) -> str:
        parts = [self._word()]
        size = len(parts[0])
        low = schema.get("minLength")
        while isinstance(low, int) and size < low:
            parts.append(self._word())
            size += 1 + len(parts[-1])
            self._budget.spend(1 + len(parts[-1]))
        text = " ".join(parts)
        high = schema.get("maxLength")
        return text[:high] if isinstance(high, int) else text

    def _word(self) -> str:
        return self._words[self._rng.randrange(len(self._words))]

    def _resolve(self, schema: dict[str, Any]) -> dict[str, Any]:
        ref = schema.get("$ref")
        for _ in range(_MAX_DEPTH):
            if not isinstance(ref, str) or not ref.startswith("#/"):
                return schema
            node: Any = self._root
            for part in ref[2:].split("/"):
                node = node.get(part) if isinstance(node, dict) else None
            if not isinstance(node, dict):
                return {}
            schema, ref = node, node.get("$ref")
        return schema


def _mapping(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _bounds(schema: dict[str, Any]) -> tuple[float, float]:
    """A closed range inside the schema's bounds (exclusive ones moved in by one)."""
    low = schema.get("minimum")
    if not isinstance(low, int | float):
        low = schema.get("exclusiveMinimum")
        low = low + 1 if isinstance(low, int | float) else 1
    high = schema.get("maximum")
    if not isinstance(high, int | float):
        high = schema.get("exclusiveMaximum")
        high = high - 1 if isinstance(high, int | float) else low + 99
    return low, max(low, high)


def prompt_words(prompt: str) -> list[str]:
    return [w.strip(".,?!\"'") for w in prompt.split() if len(w) > 3]
