"""``Job``: one client request on its way through the gateway, as the door hands it to the
``Proxy`` (``app.proxy.forward``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from app.accesslog import AccessRecord
from app.proxy.request import ParsedRequest
from app.routing.policies import RoutingContext
from app.tenants.tenant import Tenant

if TYPE_CHECKING:
    from app.proxy.attempt import Attempt
    from app.proxy.continuation import ContinuedUsage
    from app.tracing.otel import RequestTrace


@dataclass(slots=True)
class Job:
    """One client request on its way through the gateway. Its ``record`` is written by the
    request's ``Recorder`` (``app.proxy.record``) only."""

    request: ParsedRequest
    headers: list[tuple[bytes, bytes]]  # forwardable client headers
    request_id: str  # the gateway's own (records, log, trace)
    echo_id: str  # the X-Request-Id on the response: the client's if sane, else request_id
    ctx: RoutingContext
    record: AccessRecord
    started: float
    tenant: Tenant  # the key's policy and this request's priority class
    # More response headers (the key's rate-limit headers), rendered once at admission.
    response_headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    queue_wait_s: float = 0.0  # time spent in the admission queue
    attempt: Attempt | None = None  # the last upstream attempt
    trace: RequestTrace | None = None  # its spans, when tracing is on
    continued: ContinuedUsage | None = None  # a continued stream's counts, attempt by attempt

    @property
    def stream(self) -> bool:
        return self.request.stream

    @property
    def source(self) -> str | None:
        """The request's API key (breakers' attribution)."""
        return self.record.key

    @property
    def committed(self) -> bool:
        """The first upstream data event reached the client: no more retries."""
        return self.attempt is not None and self.attempt.committed
