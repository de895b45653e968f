"""Who a request is for: its API key name, that key's ``TenantPolicy`` and its priority class.

``Tenants.resolve(key, x_priority)`` is called once per request at the door. ``X-Priority`` takes
a class name (``low``, ``normal``, ``high``, any case) or its number (0, 1, 2); a class above the
key's ``max_priority`` is lowered to it (a client may lower its priority, never raise it past its
key's ceiling), anything else is a 400. The answer is one shared object per (key, class): nothing
is allocated per request.
"""

from __future__ import annotations

from dataclasses import dataclass

from app.errors import InvalidRequest
from app.tenants.config import PRIORITIES, TenantPolicy, TenantsConfig

PRIORITY_HEADER = "X-Priority"
CLASS_NAMES: tuple[str, ...] = tuple(sorted(PRIORITIES, key=PRIORITIES.__getitem__))
_BY_TEXT: dict[bytes, int] = {
    **{name.encode(): value for name, value in PRIORITIES.items()},
    **{str(value).encode(): value for value in PRIORITIES.values()},
}


@dataclass(frozen=True, slots=True)
class Tenant:
    name: str | None  # the API key's name; None when the gateway has no keys
    policy: TenantPolicy
    priority: int  # the class value (PRIORITIES)

    @property
    def priority_name(self) -> str:
        return CLASS_NAMES[self.priority]


class Tenants:
    def __init__(self, config: TenantsConfig) -> None:
        self.config = config
        self._cache: dict[tuple[str | None, int | None], Tenant] = {}

    def resolve(self, key: str | None, x_priority: bytes | None = None) -> Tenant:
        """The tenant of a request by key name ``key`` asking for ``x_priority`` (the raw
        header; None when absent). ``InvalidRequest`` (400) for a value that is not a class."""
        asked: int | None = None
        if x_priority is not None:
            asked = _BY_TEXT.get(x_priority.strip().lower())
            if asked is None:
                raise InvalidRequest(
                    f"{PRIORITY_HEADER} must be one of {', '.join(CLASS_NAMES)} "
                    f"(or {', '.join(str(PRIORITIES[n]) for n in CLASS_NAMES)})",
                    param=PRIORITY_HEADER.lower(),
                )
        tenant = self._cache.get((key, asked))
        if tenant is None:
            policy = self.config.policy(key)
            ceiling = PRIORITIES[policy.max_priority]
            value = PRIORITIES[policy.priority] if asked is None else min(asked, ceiling)
            tenant = Tenant(key, policy, value)
            if len(self._cache) < 65536:  # key names are configured ones: bounded anyway
                self._cache[(key, asked)] = tenant
        return tenant
