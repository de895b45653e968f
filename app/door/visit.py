"""One request at the door (``Visit``), the two kinds of check (``Check`` before the body is read,
``RequestCheck`` once it is parsed) and what a check holds for the response's lifetime
(``Lease``).

The door (``app.door.entrance``) runs a request through fixed stages, each handing what it found
to the next as a typed value: the headers read and forwarded, the caller's key and tenant (the
``Visit``, made once all of them are known), the body's bytes, the ``ParsedRequest``. Between
them run the configured checks: a ``Check`` looks at the ``Visit`` before the body is read, a
``RequestCheck`` at the ``Visit`` and the ``ParsedRequest``. A check refuses the request by
raising a ``GatewayError`` (answered in the surface's shape by the door). It returns None when it
is done, or an awaitable when it must wait (a shared limit store): an ``async def check`` is a
check too, and the door awaits only those, so a synchronous check costs a method call and no
coroutine.

A check that takes something the request must give back (a concurrency slot, the tokens to
charge to a quota) calls ``visit.hold(lease)``; the door releases the visit's leases in reverse
order once the response ended -- a streamed one at its last byte, or when its client left -- or
at once when a later step refuses the request, before its refusal is sent. A lease that keeps no
state of its own is the check object itself (``release`` is given the visit), so holding one
allocates nothing. Its ``release`` may be an ``async def`` too; one that fails is logged, never
the request's failure.
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any, Protocol

from app.door.request_id import echo_id_of

if TYPE_CHECKING:
    from app.door.entry import Entry
    from app.proxy.job import Job
    from app.proxy.request import ParsedRequest
    from app.tenants.tenant import Tenant
    from app.tracing.otel import RequestTrace


class Visit:
    """One request at the door once its head was read: the route's ``entry``, the ASGI
    ``scope``, when it arrived, its ids, the headers the entry reads (``read``) and those a
    worker gets (``forwarded``), the caller's key name (None while the gateway is open) and
    tenant, and its server span (tracing on). Made once, with all of them; what the checks add
    later is what every answer carries (``response_headers``, the key's rate-limit headers) and
    what the request holds (``hold``)."""

    __slots__ = (
        "echo_id",
        "entry",
        "forwarded",
        "key",
        "leases",
        "read",
        "request_id",
        "response_headers",
        "scope",
        "started",
        "tenant",
        "trace",
    )

    def __init__(
        self,
        entry: Entry,
        scope: Any,
        started: float,
        request_id: str,
        read: dict[bytes, bytes],
        forwarded: list[tuple[bytes, bytes]],
        key: str | None,
        tenant: Tenant,
        trace: RequestTrace | None,
    ) -> None:
        self.entry = entry
        self.scope = scope
        self.started = started
        self.request_id = request_id  # the gateway's own (records, log, trace)
        self.echo_id = echo_id_of(scope)  # the X-Request-Id the client gets and the worker is sent
        self.read = read
        self.forwarded = forwarded
        self.key = key
        self.tenant = tenant
        self.trace = trace
        self.response_headers: list[tuple[bytes, bytes]] = []  # from admission on, refusals too
        self.leases: list[Lease] | None = None

    def hold(self, lease: Lease) -> None:
        """Release ``lease`` when the response ends (or the request is refused)."""
        if self.leases is None:
            self.leases = [lease]
        else:
            self.leases.append(lease)


class Check(Protocol):
    def check(self, visit: Visit) -> Awaitable[None] | None:
        """Look at the request before its body is read (raise a ``GatewayError`` to refuse it);
        an awaitable when the check must wait."""


class RequestCheck(Protocol):
    def check(self, visit: Visit, request: ParsedRequest) -> Awaitable[None] | None:
        """Look at the parsed request (raise a ``GatewayError`` to refuse it); an awaitable when
        the check must wait."""


class Lease(Protocol):
    def release(self, visit: Visit, job: Job | None) -> Awaitable[None] | None:
        """Give back what was held for ``visit``; ``job`` is the request the proxy ran, None
        when a later step refused it."""
