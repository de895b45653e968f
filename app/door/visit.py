"""One request at the door (``Visit``), the shape of a check (``Check``) and of what a check holds
for the response's lifetime (``Lease``).

A check is a small object built once at start-up (``app.door.entrance.checks``): ``check(visit)``
reads what earlier checks left on the visit, adds what it finds, and refuses the request by
raising a ``GatewayError`` (answered in the surface's shape by the door). It returns None when it
is done, or an awaitable when it must wait (reading the body, a shared limit store): an
``async def check`` is a check too, and the door awaits only those, so a synchronous check costs
a method call and no coroutine.

A check that takes something the request must give back (a concurrency slot, an open trace
span, the tokens to charge to a quota) calls ``visit.hold(lease)``; the door releases the
visit's leases in reverse order once the response ended -- a streamed one at its last byte, or
when its client left -- or at once when a later check refuses the request, before its refusal
is sent. A lease is usually the check object itself (``release(visit)`` reads the request's
state from the visit), so holding one allocates nothing. Its ``release`` may be an ``async
def`` too; one that fails is logged, never the request's failure.
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any, Protocol

from app.proxy.downstream import Receive

if TYPE_CHECKING:
    from app.door.entry import Entry
    from app.proxy.job import Job
    from app.proxy.request import ParsedRequest
    from app.tenants.tenant import Tenant
    from app.tracing.otel import RequestTrace


class Visit:
    """One request on its way through the door's checks: the route's ``entry``, the ASGI
    ``scope``/``receive``, and what the checks found. ``job`` is set once the proxy runs the
    request; ``error`` when a check refused it."""

    __slots__ = (
        "echo_id",
        "entry",
        "error",
        "forwarded",
        "job",
        "key",
        "leases",
        "limit_headers",
        "parsed",
        "raw",
        "read",
        "receive",
        "request_id",
        "scope",
        "slot",
        "started",
        "tenant",
        "trace",
    )

    def __init__(self, entry: Entry, scope: Any, receive: Receive, started: float) -> None:
        self.entry = entry
        self.scope = scope
        self.receive = receive
        self.started = started
        self.request_id = ""  # the gateway's own (records, log, trace)
        self.echo_id = ""  # the X-Request-Id the client gets back and the worker is sent
        self.trace: RequestTrace | None = None
        self.read: dict[bytes, bytes] = {}  # the headers the entry reads
        self.forwarded: list[tuple[bytes, bytes]] = []  # the headers a worker gets
        self.key: str | None = None  # the caller's key name; None while the gateway is open
        self.tenant: Tenant | None = None
        self.limit_headers: list[tuple[bytes, bytes]] = []  # on every answer from admission on
        self.slot: Any = None  # the key's limiter hold (an async context manager), when taken
        self.raw = b""
        self.parsed: ParsedRequest | None = None
        self.job: Job | None = None
        self.error: BaseException | None = None
        self.leases: list[Lease] | None = None

    def hold(self, lease: Lease) -> None:
        """Release ``lease`` when the response ends (or the request is refused)."""
        if self.leases is None:
            self.leases = [lease]
        else:
            self.leases.append(lease)


class Check(Protocol):
    def check(self, visit: Visit) -> Awaitable[None] | None:
        """Look at the request (raise a ``GatewayError`` to refuse it); an awaitable when the
        check must wait."""


class Lease(Protocol):
    def release(self, visit: Visit) -> Awaitable[None] | None:
        """Give back what was held for ``visit``; ``visit.job`` is None when the request was
        refused (``visit.error``) before the proxy ran it."""
