"""The entrance of every completion surface: ``checks(gw)``, the configured checks, and ``Door``,
which runs a request through its stages and hands it to the proxy.

Every POST route of the surface registry (``app.surfaces``: chat, completions, Messages,
count_tokens, Responses) comes through the same stages, each handing what it found to the next
as a typed value (``app.door.visit``):

1. the ids (the gateway's own, the X-Request-Id echoed) and, tracing on, the server span;
2. the headers the entry reads and those a worker gets (a repeated one: 400), the caller's API
   key (401; only while keys are configured) and tenant (its policy, ``X-Priority``: 400): the
   ``Visit``;
3. the ``Check``s, on the ``Visit``: the key's limits and quotas (429; from here on every
   answer carries the key's rate-limit headers), the media type (415);
4. the body (413 past the cap; 499 when the client leaves while sending it; nothing when the
   server answered the request itself, e.g. a 408 for a body too slow: it recorded that);
5. the ``ParsedRequest``: the entry's ``parse``, or its ``load`` awaited (400 naming the field);
6. the ``RequestCheck``s, on the ``Visit`` and the ``ParsedRequest``: draining (503), the model
   (404; 503 while no worker serves it).

The checks are built once at start-up from the configuration (no key limits while the gateway is
open). A refusal releases the leases taken so far (``app.door.visit``) and is answered in the
surface's shape, logged and counted (``app.door.reject``). A request every step let through
becomes the proxy's ``Job``; the proxy answers it, and once its response ended -- a streamed one
at its last byte, or when its client left -- the door releases the request's leases (the key's
limiter slot, the tokens charged to its quotas) and ends its span.

A new admission rule is a class with ``check(visit)`` or ``check(visit, request)``
(``app.door.checks`` holds the built-in ones) and one line in ``checks``; the worker-side
admission (the per-worker cap and the fair queue, ``app.workers.admission``) stays in the proxy,
which asks it again before every attempt.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from app.accesslog import AccessRecord
from app.door import checks as door
from app.door.api_keys import key_name
from app.door.checks import read_body
from app.door.entry import Entry, LoadingEntry
from app.door.limits import KeyLimits
from app.door.reject import asked_for, refuse
from app.door.request_id import client_request_id_of, echo_id_of, request_id_of
from app.door.visit import Check, RequestCheck, Visit
from app.errors import GatewayError
from app.gateway import Gateway
from app.proxy.direct import direct_body
from app.proxy.downstream import Receive, Send
from app.proxy.headers import client_headers
from app.proxy.job import Job
from app.proxy.request import ParsedRequest
from app.routing.policies import RoutingContext
from app.routing.prefix import prefix_blocks
from app.routing.routing_key import SESSION_HEADER, routing_key
from app.tenants.tenant import PRIORITY_HEADER

if TYPE_CHECKING:
    from app.tracing.otel import RequestTrace

log = logging.getLogger(__name__)

_SESSION = SESSION_HEADER.encode("ascii")
_PRIORITY = PRIORITY_HEADER.lower().encode("ascii")
_LENGTH = b"content-length"


@dataclass(frozen=True, slots=True)
class Checks:
    """The door's checks, in the order a request meets them: ``before_body`` on the ``Visit``,
    ``after_parse`` on the ``Visit`` and the ``ParsedRequest``."""

    before_body: tuple[Check, ...]
    after_parse: tuple[RequestCheck, ...]


# The checks a gateway runs, given the gateway: ``checks`` or checks built on it.
BuildChecks = Callable[[Gateway], Checks]


def checks(gw: Gateway) -> Checks:
    """The door's checks, in the order a request meets them."""
    keyed = not gw.keys.open
    return Checks(
        before_body=(
            *([KeyLimits(gw)] if keyed else []),
            door.MediaType(),
        ),
        after_parse=(
            door.Accepting(gw),
            door.Model(gw),
        ),
    )


class Door:
    """Serves any entry of the registry: its stages, then the proxy (see the module doc)."""

    def __init__(self, gw: Gateway, build: BuildChecks = checks) -> None:
        self._gw = gw
        self._proxy = gw.proxy
        self._tracer = gw.tracer
        self._tenants = gw.tenants
        self._forward = gw.forward_headers
        self._keyed = not gw.keys.open
        self._body_limit = gw.settings.limits.max_body_bytes
        # Only cache_aware reads a request's block chain: no hashing for the other policies.
        self._hash_prefix = gw.proxy.hashes_prefix
        self.checks = build(gw)
        self._before_body = self.checks.before_body
        self._after_parse = self.checks.after_parse

    async def serve(self, entry: Entry, scope: Any, receive: Receive, send: Send) -> None:
        """Answer one request of ``entry``'s API."""
        gw, proxy = self._gw, self._proxy
        started = proxy.now()
        request_id = request_id_of(scope)
        tracer = self._tracer
        # What a refusal names, as far as the request got.
        trace: RequestTrace | None = None
        key: str | None = None
        visit: Visit | None = None
        request: ParsedRequest | None = None
        raw = b""
        try:
            if tracer is not None:
                trace = tracer.begin(scope["headers"], entry.route, request_id, started)
            read, forwarded = client_headers(scope["headers"], entry.read, self._forward)
            if self._keyed:
                key = key_name(entry.credential(read), gw, entry.key_texts(read))
            tenant = self._tenants.resolve(key, read.get(_PRIORITY))
            visit = Visit(entry, scope, started, request_id, read, forwarded, key, tenant, trace)
            for check in self._before_body:
                pending = check.check(visit)
                if pending is not None:
                    await pending
            raw = await read_body(receive, read.get(_LENGTH), self._body_limit)
            if isinstance(entry, LoadingEntry):
                request = await entry.load(gw, raw, key)
            else:
                request = entry.parse(gw, raw)
            for later in self._after_parse:
                pending = later.check(visit, request)
                if pending is not None:
                    await pending
        except BaseException as exc:
            if visit is not None and visit.leases is not None:
                await _release(visit, None)
            if trace is not None:
                _refused(trace, exc, key)
            if not isinstance(exc, Exception):  # cancelled: the server is going away
                raise
            headers = visit.response_headers if visit is not None else []
            await self._refuse(exc, entry, scope, send, started, key, headers, request, raw)
            return
        job: Job | None = None
        try:
            job = self._job(visit, request)
            learns = proxy.learns
            if learns is not None and (reading := learns.recall(job.ctx)) is not None:
                await reading  # where the replicas last sent this session (cache_aware)
            await proxy.run(job, receive, send, direct_body(scope))
        finally:
            if visit.leases is not None:
                await _release(visit, job)
            if trace is not None and job is not None:
                _finished(trace, job)

    async def _refuse(
        self,
        exc: Exception,
        entry: Entry,
        scope: Any,
        send: Send,
        started: float,
        key: str | None,
        headers: list[tuple[bytes, bytes]],
        request: ParsedRequest | None,
        raw: bytes,
    ) -> None:
        """Answer a request a step refused (with ``exc``), in its surface's shape."""
        lane = direct_body(scope)
        if lane is not None and lane.stopped():  # the server answered and recorded it
            return
        request_id = request_id_of(scope)
        if not isinstance(exc, GatewayError):  # a bug: log it, never show it
            log.exception("request %s failed inside the gateway", request_id, exc_info=exc)
            exc = GatewayError("internal error")
        await refuse(
            self._gw,
            send,
            entry.route,
            request_id,
            exc,
            entry.shape,
            headers,
            key=key,
            duration_s=self._proxy.now() - started,
            asked=asked_for(request, raw),
            client_request_id=client_request_id_of(scope),
            echo_id=echo_id_of(scope),
        )

    def _job(self, visit: Visit, parsed: ParsedRequest) -> Job:
        """The request as the proxy runs it."""
        route, tenant = visit.entry.route, visit.tenant
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
            visit.response_headers,
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


async def _release(visit: Visit, job: Job | None) -> None:
    """The visit's leases, last taken first (``job``: None when the request was refused); one
    that fails is logged and the others still released."""
    leases = visit.leases or ()
    visit.leases = None
    for lease in reversed(leases):
        try:
            pending = lease.release(visit, job)
            if pending is not None:
                await pending
        except Exception:
            log.exception("request %s: releasing %r failed", visit.request_id, lease)


def _finished(trace: RequestTrace, job: Job) -> None:
    """The request's span ended as its record says (a failure is logged, never the request's)."""
    try:
        trace.finish(job.record, job.queue_wait_s)
    except Exception:
        log.exception("request %s: ending its span failed", job.request_id)


def _refused(trace: RequestTrace, error: BaseException, key: str | None) -> None:
    """The span of a request refused with ``error``."""
    try:
        trace.refused(error, key)
    except Exception:
        log.exception("ending a refused request's span failed")
