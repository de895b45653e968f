"""The entrance of every completion surface: ``checks(gw)``, the one ordered list of checks, and
``Door``, which runs a request through it and hands it to the proxy.

Every POST route of the surface registry (``app.surfaces``: chat, completions, Messages,
count_tokens, Responses) comes through the same list, built once at start-up from the
configuration (no trace check while tracing is off, no key checks while the gateway is open).
A check refuses by raising: the leases taken so far are released (``app.door.visit``), and the
refusal is answered in the surface's shape, logged and counted (``app.door.reject``). A request
every check let through becomes the proxy's ``Job``; the proxy answers it, and once its response
ended -- a streamed one at its last byte, or when its client left -- the door releases the
request's leases (the key's limiter slot, the tokens charged to its quotas, the trace's span).

A new admission rule is a class with ``check(visit)`` (``app.door.checks`` holds the built-in
ones) and one line in ``checks``; the worker-side admission (the per-worker cap and the fair
queue, ``app.workers.admission``) stays in the proxy, which asks it again before every attempt.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from app.accesslog import AccessRecord
from app.door import checks as door
from app.door.entry import Entry
from app.door.limits import KeyLimits
from app.door.reject import asked_for, refuse
from app.door.request_id import client_request_id_of, echo_id_of, request_id_of
from app.door.visit import Check, Visit
from app.errors import GatewayError
from app.gateway import Gateway
from app.proxy.direct import direct_body
from app.proxy.downstream import Receive, Send
from app.proxy.job import Job
from app.proxy.request import ParsedRequest
from app.routing.policies import RoutingContext
from app.routing.prefix import prefix_blocks
from app.routing.routing_key import SESSION_HEADER, routing_key

log = logging.getLogger(__name__)

_SESSION = SESSION_HEADER.encode("ascii")
# The checks a gateway runs, given the gateway: ``checks`` or a list built on it.
Checks = Callable[[Gateway], Sequence[Check]]


def checks(gw: Gateway) -> list[Check]:
    """The door's checks, in the order a request meets them."""
    keyed = not gw.keys.open
    return [
        door.RequestId(),
        *([door.Trace(gw)] if gw.tracer is not None else []),
        door.Headers(gw),
        *([door.Key(gw)] if keyed else []),
        door.Tenancy(gw),
        *([KeyLimits(gw)] if keyed else []),
        door.MediaType(),
        door.Body(gw),
        door.Parse(gw),
        door.Accepting(gw),
        door.Model(gw),
    ]


class Door:
    """Serves any entry of the registry: its checks, then the proxy (see the module doc)."""

    def __init__(self, gw: Gateway, build: Checks = checks) -> None:
        self._gw = gw
        self._proxy = gw.proxy
        # Only cache_aware reads a request's block chain: no hashing for the other policies.
        self._hash_prefix = gw.proxy.hashes_prefix
        self.checks: tuple[Check, ...] = tuple(build(gw))

    async def serve(self, entry: Entry, scope: Any, receive: Receive, send: Send) -> None:
        """Answer one request of ``entry``'s API."""
        proxy = self._proxy
        visit = Visit(entry, scope, receive, proxy.now())
        try:
            for check in self.checks:
                pending = check.check(visit)
                if pending is not None:
                    await pending
        except BaseException as exc:
            visit.error = exc
            if visit.leases is not None:
                await _release(visit)
            if not isinstance(exc, Exception):  # cancelled: the server is going away
                raise
            lane = direct_body(scope)
            if lane is not None and lane.stopped():  # the server answered and recorded it
                return
            request_id = visit.request_id or request_id_of(scope)
            if not isinstance(exc, GatewayError):  # a bug: log it, never show it
                log.exception("request %s failed inside the gateway", request_id)
                exc = GatewayError("internal error")
            await refuse(
                self._gw,
                send,
                entry.route,
                request_id,
                exc,
                entry.surface.shape,
                visit.limit_headers,
                key=visit.key,
                duration_s=proxy.now() - visit.started,
                asked=asked_for(visit.parsed, visit.raw),
                client_request_id=client_request_id_of(scope),
                echo_id=echo_id_of(scope),
            )
            return
        try:
            job = visit.job = self._job(visit)
            await proxy.run(job, receive, send, direct_body(scope))
        finally:
            if visit.leases is not None:
                await _release(visit)

    def _job(self, visit: Visit) -> Job:
        """The request as the proxy runs it."""
        parsed, tenant, route = visit.parsed, visit.tenant, visit.entry.route
        assert parsed is not None and tenant is not None
        request_id = visit.request_id
        forwarded = visit.forwarded
        forwarded.append((b"x-request-id", visit.echo_id.encode("ascii")))
        session = visit.read.get(_SESSION)
        ctx = RoutingContext(
            parsed.served_model,
            routing_key(parsed, session.decode("latin-1") if session else None),
            prefix_blocks(
                parsed.prefix,
                lead_parts=_lead_parts(parsed),
                new_parts=2 if len(parsed.prefix) > 1 else 1,  # a chat's last message; a prompt
            )
            if self._hash_prefix
            else None,
        )
        if parsed.dropped is not None:
            self._gw.metrics.record_dropped_fields(route)
        record = AccessRecord(
            request_id,
            route,
            parsed.served_model,
            parsed.stream,
            client_request_id=client_request_id_of(visit.scope),
            key=visit.key,
            priority=tenant.priority_name,
        )
        return Job(
            parsed,
            forwarded,
            request_id,
            visit.echo_id,
            ctx,
            record,
            visit.started,
            tenant,
            visit.limit_headers,
            trace=visit.trace,
        )


def _lead_parts(parsed: ParsedRequest) -> int:
    """How many of the prompt's parts are the lead many sessions share: a chat's tools and its
    messages before the first user turn (the system prompt); a text prompt: none."""
    prefix, conversation = parsed.prefix, parsed.conversation
    if len(prefix) < 2:
        return 0
    tools = len(prefix) % 2  # a chat's parts: the tools array, if any, then two per message
    user = 2 if len(conversation) >= 2 and bytes(conversation[-2]) == b"user" else 0
    return tools + len(conversation) - user


async def _release(visit: Visit) -> None:
    """The visit's leases, last taken first; one that fails is logged and the others still
    released."""
    leases = visit.leases
    assert leases is not None
    visit.leases = None
    for lease in reversed(leases):
        try:
            pending = lease.release(visit)
            if pending is not None:
                await pending
        except Exception:
            log.exception("request %s: releasing %r failed", visit.request_id, lease)
