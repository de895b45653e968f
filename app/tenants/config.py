"""``tenants.*`` settings (a section of ``app.config.Settings``): what each API key is entitled to.

A tenant is an API key NAME (``auth``). Each has a ``TenantPolicy``: its weight in the fair share
of worker slots, its default priority class and the highest class its clients may ask for with
``X-Priority``, and its token quotas. ``tenants.keys`` maps key names to their policy; every other
key (and every request when no keys are configured) gets ``tenants.default``::

    tenants:
      default: {weight: 1, priority: normal, max_priority: normal}
      keys:
        search-prod: {weight: 4, priority: high, max_priority: high, tokens_per_min: 2000000}
        nightly-evals: {weight: 1, priority: low, max_priority: normal, tokens_per_day: 50000000}

Priority classes, lowest first, with the value SGLang is given in the request's ``priority`` field
when ``workers.priority_scheduling`` is on (SGLang's default order serves larger values first):
``low`` = 0, ``normal`` = 1, ``high`` = 2.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from app.sections import Section

PriorityName = Literal["low", "normal", "high"]
PRIORITIES: dict[str, int] = {"low": 0, "normal": 1, "high": 2}


class TenantPolicy(Section):
    # Share of worker slots against the other keys waiting in the same priority class.
    weight: float = Field(1.0, gt=0, le=1000)
    # The class of a request without X-Priority.
    priority: PriorityName = "normal"
    # The highest class X-Priority may ask for (a higher one is lowered to this); not below
    # priority.
    max_priority: PriorityName = "normal"
    # Prompt + completion tokens (from each answer's usage) per rolling minute and per UTC day;
    # None: no quota. Over either, requests get 429 + Retry-After until the window frees tokens.
    tokens_per_min: int | None = Field(None, ge=1)
    # Prompt + completion tokens per UTC day (the budget starts again at 00:00 UTC); None: none.
    tokens_per_day: int | None = Field(None, ge=1)
    # Continue this key's chat streams on another worker when theirs breaks (up to
    # retry.mid_stream_attempts times); false: the stream ends with an in-band error instead.
    continue_streams: bool = True

    @model_validator(mode="after")
    def _ceiling(self) -> TenantPolicy:
        if PRIORITIES[self.priority] > PRIORITIES[self.max_priority]:
            raise ValueError("priority must not be above max_priority")
        return self


class TenantsConfig(Section):
    """Per-API-key policy (by key name): fair-share weight, priority classes, token quotas, and
    the usage log."""

    default: TenantPolicy = TenantPolicy()
    # Policies by API key name (the NAME of NAME:KEY entries).
    keys: dict[str, TenantPolicy] = Field(default_factory=dict)
    # One JSON line per finished request, for billing (None: off); rotated at usage_log_max_bytes
    # keeping usage_log_backups old files. Written by a background thread: when it falls behind
    # by usage_log_queue lines (a full or slow disk), lines are dropped and counted, never waited
    # for.
    usage_log: Path | None = None
    # Rotate the usage log before a line would take it past this size.
    usage_log_max_bytes: int = Field(100 * 1024 * 1024, ge=4096)
    # Rotated files kept (usage.jsonl.1, .2, ...); 0: the file starts afresh.
    usage_log_backups: int = Field(5, ge=0, le=1000)
    # Lines that may wait for the writer thread; more are dropped and counted.
    usage_log_queue: int = Field(10000, ge=1)

    def policy(self, key: str | None) -> TenantPolicy:
        """The policy of key name ``key`` (``default`` for None or an unlisted name)."""
        if key is None:
            return self.default
        return self.keys.get(key, self.default)
