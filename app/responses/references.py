"""A request's input items as the store keeps them, and ``item_reference`` items resolved.

``request_items`` gives the request's ``input`` as items, each with an ``id`` (the client's, or a
new one): what ``GET /v1/responses/{id}/input_items`` lists later. An ``item_reference``
(``{"type": "item_reference", "id": ...}``) stands for an item the client sent or got before: it
is replaced by that item, looked up among the input and output items of the response named by
``previous_response_id`` (the gateway keeps no other index of items). A reference it cannot
resolve is a 400 naming it.
"""

from __future__ import annotations

import secrets
from typing import Any

from app.errors import InvalidRequest

REFERENCE = "item_reference"
_PREFIX = {
    "message": "msg",
    "function_call": "fc",
    "function_call_output": "fco",
    "custom_tool_call": "ctc",
    "custom_tool_call_output": "ctco",
}


def _new_id(kind: object) -> str:
    prefix = _PREFIX.get(kind, "item") if isinstance(kind, str) else "item"
    return f"{prefix}_{secrets.token_hex(16)}"


def request_items(value: object) -> list[dict[str, Any]] | None:
    """``input`` as a list of items with ids (a string is one user message); None when it is
    neither (the translator's check answers that)."""
    if isinstance(value, str):
        text = {"type": "input_text", "text": value}
        return [{"type": "message", "role": "user", "content": [text], "id": _new_id("message")}]
    if not isinstance(value, list):
        return None
    items: list[dict[str, Any]] = []
    for item in value:
        if not isinstance(item, dict):
            return None
        if item.get("type") != REFERENCE and not isinstance(item.get("id"), str):
            item = {**item, "id": _new_id(item.get("type", "message"))}
        if item.get("type", "message") == "message" and isinstance(item.get("content"), str):
            # As OpenAI lists it: a message's text is a content part.
            part = "output_text" if item.get("role") == "assistant" else "input_text"
            item = {"type": "message", **item, "content": [{"type": part, "text": item["content"]}]}
        items.append(item)
    return items


def has_references(items: list[dict[str, Any]] | None) -> bool:
    return items is not None and any(item.get("type") == REFERENCE for item in items)


def stored_items(record: dict[str, Any] | None) -> dict[str, dict[str, Any]]:
    """The items of a stored response a reference may name, by id: its input, then its output."""
    if record is None:
        return {}
    found: dict[str, dict[str, Any]] = {}
    response = record.get("response")
    output = response.get("output") if isinstance(response, dict) else None
    for items in (record.get("input"), output):
        if isinstance(items, list):
            for item in items:
                if isinstance(item, dict) and isinstance(item.get("id"), str):
                    found[item["id"]] = item
    return found


def resolve(items: list[dict[str, Any]], record: dict[str, Any] | None) -> list[dict[str, Any]]:
    """``items`` with each ``item_reference`` replaced by the item it names (400 if none)."""
    known = stored_items(record)
    resolved: list[dict[str, Any]] = []
    for index, item in enumerate(items):
        if item.get("type") != REFERENCE:
            resolved.append(item)
            continue
        where = f"input.{index}"
        ref = item.get("id")
        if not isinstance(ref, str) or not ref:
            raise InvalidRequest(f"{where}.id: an item_reference needs an id", param=f"{where}.id")
        if record is None:
            raise InvalidRequest(
                f"{where}: an item_reference is resolved among the items of the response named "
                "by previous_response_id; send previous_response_id (or the item itself)",
                param=where,
            )
        target = known.get(ref)
        if target is None or target.get("type") == REFERENCE:
            raise InvalidRequest(
                f"{where}.id: no item {ref[:64]!r} in the previous response's input or output",
                param=f"{where}.id",
            )
        resolved.append(target)
    return resolved
