"""``responses.*`` settings (a section of ``app.config.Settings``): where ``/v1/responses`` keeps
its responses, for how long, and each key's share."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from app.sections import Section


class ResponsesConfig(Section):
    """Stored responses of ``/v1/responses`` (``app.response_store``): ``none`` keeps nothing
    (``previous_response_id`` is a 400), ``memory`` keeps them in this process, ``redis`` in the
    Redis of ``limits.redis_url`` (shared by every replica)."""

    # Where responses are kept for previous_response_id and GET/DELETE /v1/responses/{id}: none,
    # memory (this process only; refused with --processes > 1) or redis (limits.redis_url).
    store: Literal["none", "memory", "redis"] = "none"
    # Seconds a stored response stays readable after it completed.
    ttl_s: float = Field(3600.0, gt=0)
    # The in-process store's bounds (least recently used out first); a larger record is not kept.
    # When the whole store is full, the key holding the most gives way.
    max_items: int = Field(10_000, ge=1)
    # The in-process store's total size bound, in bytes of stored JSON (as max_items).
    max_bytes: int = Field(256 * 1024 * 1024, ge=1024 * 1024)
    # Each API key's share of the store (memory and redis), in bytes of stored JSON: a key's
    # write past it evicts that key's own oldest responses, never another key's; a larger record
    # is not kept. Without API keys the whole gateway is one key.
    key_max_bytes: int = Field(32 * 1024 * 1024, ge=64 * 1024)
    # Each API key's share of the store in responses (memory and redis), as key_max_bytes.
    key_max_items: int = Field(1000, ge=1)
