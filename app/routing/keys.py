"""The routing key ``prefix_affinity`` hashes (CONTRACTS.md): ``X-Session-Id``, else the request's
``user`` field, else a hash of the leading conversation (system prompt + first user turn), so every
turn of one conversation shares a key and lands where SGLang's radix cache holds its prefix."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import orjson

SESSION_HEADER = "x-session-id"
_MAX_KEY_CHARS = 256


def routing_key(body: Mapping[str, Any], session: str | None = None) -> str | None:
    if session:
        return "s:" + session[:_MAX_KEY_CHARS]
    user = body.get("user")
    if isinstance(user, str) and user:
        return "u:" + user[:_MAX_KEY_CHARS]
    leading = _leading_conversation(body)
    if leading is None:
        return None
    return "c:" + hashlib.blake2b(leading, digest_size=16).hexdigest()


def _leading_conversation(body: Mapping[str, Any]) -> bytes | None:
    messages = body.get("messages")
    if isinstance(messages, list):
        head: list[Any] = []
        for message in messages:
            if not isinstance(message, dict):
                return None
            head.append([message.get("role"), message.get("content")])
            if message.get("role") == "user":
                break
        if not head:
            return None
        try:
            return orjson.dumps(head)
        except TypeError:  # nested deeper than orjson writes: no affinity for this one
            return None
    prompt = body.get("prompt")
    if isinstance(prompt, str) and prompt:
        # Completions: the first 2 KiB stand in for the shared prefix (system prompt, few-shots).
        return prompt[:2048].encode()
    return None
