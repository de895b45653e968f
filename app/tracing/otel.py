"""Traces of completion requests with the OpenTelemetry SDK (imported only when tracing is on).

One trace per request, parented on the client's ``traceparent``/``tracestate`` when it sent them::

    POST /v1/chat/completions   SERVER  request id, route, model, key, priority, status, outcome,
      │                                 tokens, acceptance length, attempts, queue wait
      ├─ admission              INTERNAL  each wait for a worker slot (the admission queue)
      ├─ attempt                CLIENT    each try on a worker: worker, rid, outcome, status;
      │                                   event ``first_token`` when its first data event went out
      └─ ...                              (a retry: admission and attempt again)

The attempt span exists from the moment its request is sent: its context goes to the worker as
``traceparent`` (and ``tracestate``), in place of the client's. Everything else is set when the
span ends, from what the gateway records anyway (the relay's tally, the access record): tracing
adds nothing per relayed chunk. Times are the gateway's clock (``Proxy.now``), turned into wall
time with one offset taken when the request arrives.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Protocol

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SimpleSpanProcessor,
    SpanExporter,
)
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.util.types import AttributeValue

from app import __version__
from app.errors import GatewayError, UpstreamStatusError
from app.outcomes import Outcome
from app.tracing.config import TracingConfig

if TYPE_CHECKING:
    from app.accesslog import AccessRecord

Clock = Callable[[], float]
Headers = list[tuple[bytes, bytes]]


# What the spans read of the proxy's request (``app.proxy.job.Job``) and of one attempt
# (``app.proxy.attempt.Attempt``): the proxy sits above tracing and hands itself in.
class _Named(Protocol):
    @property
    def name(self) -> str: ...


class _Tally(Protocol):
    @property
    def first_at(self) -> float | None: ...


class Attempt(Protocol):
    @property
    def worker(self) -> _Named: ...

    @property
    def rid(self) -> str: ...

    @property
    def started(self) -> float: ...

    @property
    def status_code(self) -> int: ...

    @property
    def outcome(self) -> Outcome: ...

    @property
    def tally(self) -> _Tally: ...


class _Attempts(Protocol):
    @property
    def attempts(self) -> int: ...


class Job(Protocol):
    @property
    def queue_wait_s(self) -> float: ...

    @property
    def headers(self) -> Headers: ...

    @property
    def record(self) -> _Attempts: ...


_TRACEPARENT = b"traceparent"
_TRACESTATE = b"tracestate"
_PROPAGATOR = TraceContextTextMapPropagator()


def _exporter(config: TracingConfig) -> SpanExporter:
    if config.exporter == "console":
        return ConsoleSpanExporter(service_name=config.service_name)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter(endpoint=config.otlp_endpoint)


class Tracing:
    """The process's tracer: ``begin`` one ``RequestTrace`` per request, ``shutdown`` at exit
    (exports what is still buffered). ``exporter`` replaces the configured one; its spans are
    handed over as each ends (the configured exporters get them in batches, off the event loop).
    """

    def __init__(
        self, config: TracingConfig, *, clock: Clock, exporter: SpanExporter | None = None
    ) -> None:
        processor: SpanProcessor = (
            BatchSpanProcessor(_exporter(config))
            if exporter is None
            else SimpleSpanProcessor(exporter)
        )
        self._provider = TracerProvider(
            sampler=ParentBased(TraceIdRatioBased(config.sample_ratio)),
            resource=Resource.create({"service.name": config.service_name}),
            shutdown_on_exit=False,  # the gateway's lifespan shuts it down
        )
        self._provider.add_span_processor(processor)
        self._tracer = self._provider.get_tracer("dflash-gateway", __version__)
        self._clock = clock

    def begin(
        self, headers: Iterable[tuple[bytes, bytes]], route: str, request_id: str, started: float
    ) -> RequestTrace:
        """The server span of a request that arrived at ``started`` (clock) with ``headers``."""
        carrier: dict[str, str] = {}
        for name, value in headers:
            if name in (_TRACEPARENT, _TRACESTATE):
                text, key = value.decode("latin-1"), name.decode("ascii")
                carrier[key] = f"{carrier[key]},{text}" if key in carrier else text
        parent = _PROPAGATOR.extract(carrier, context=Context()) if carrier else Context()
        now = time.time_ns()  # wall time for the gateway's clock: one offset per request
        offset = now - round(started * 1e9)
        span = self._tracer.start_span(
            f"POST {route}",
            context=parent,
            kind=SpanKind.SERVER,
            attributes={
                "http.request.method": "POST",
                "http.route": route,
                "dflash.request_id": request_id,
            },
            start_time=now,
        )
        return RequestTrace(self._tracer, span, offset, self._clock)

    def shutdown(self) -> None:
        self._provider.shutdown()


class RequestTrace:
    """The spans of one request; see the module doc. The proxy calls ``admitting`` before each
    wait for a slot, ``attempt`` as each attempt is sent and ``attempt_ended`` after it; the door
    calls ``finish`` (or ``refused``) once."""

    __slots__ = (
        "_admission",
        "_attempt",
        "_clock",
        "_context",
        "_offset",
        "_recording",
        "_span",
        "_tracer",
        "_waited",
    )

    def __init__(self, tracer: trace.Tracer, span: Span, offset: int, clock: Clock) -> None:
        self._tracer = tracer
        self._span = span
        self._context = trace.set_span_in_context(span, Context())
        # Not sampled: no child spans either; the workers get this span's context (flagged not
        # sampled), so they agree.
        self._recording = span.is_recording()
        self._offset = offset
        self._clock = clock
        self._admission: tuple[Span, float] | None = None  # open admission span, its start
        self._attempt: Span | None = None
        self._waited = 0.0  # the job's queue wait already put on admission spans

    def _ns(self, at: float) -> int:
        return self._offset + round(at * 1e9)

    def admitting(self) -> None:
        """The request starts waiting for a worker slot."""
        if not self._recording:
            return
        at = self._clock()
        span = self._tracer.start_span("admission", context=self._context, start_time=self._ns(at))
        self._admission = (span, at)

    def _admitted(self, at: float, waited: float | None = None) -> None:
        if self._admission is None:
            return
        span, start = self._admission
        self._admission = None
        span.set_attribute("dflash.queue_wait_s", at - start if waited is None else waited)
        span.end(end_time=self._ns(at))

    def attempt(self, job: Job, attempt: Attempt) -> Headers:
        """The span of ``attempt``, about to be sent, and the headers to send with it: the
        client's, with this span as the worker's parent."""
        context = self._context
        if self._recording:
            waited, self._waited = job.queue_wait_s - self._waited, job.queue_wait_s
            self._admitted(attempt.started, waited)
            span = self._attempt = self._tracer.start_span(
                "attempt",
                context=context,
                kind=SpanKind.CLIENT,
                attributes={
                    "dflash.worker": attempt.worker.name,
                    "dflash.rid": attempt.rid,
                    "dflash.attempt": job.record.attempts,
                },
                start_time=self._ns(attempt.started),
            )
            context = trace.set_span_in_context(span, Context())
        carrier: dict[str, str] = {}
        _PROPAGATOR.inject(carrier, context=context)
        headers = [h for h in job.headers if h[0] != _TRACEPARENT and h[0] != _TRACESTATE]
        headers.extend((k.encode("ascii"), v.encode("latin-1")) for k, v in carrier.items())
        return headers

    def attempt_ended(self, attempt: Attempt) -> None:
        """``attempt`` settled (called while its error, if any, propagates)."""
        span, self._attempt = self._attempt, None
        if span is None:
            return
        error = sys.exception()
        status = attempt.status_code
        if not status and isinstance(error, UpstreamStatusError):
            status = error.status
        attributes: dict[str, AttributeValue] = {"dflash.outcome": attempt.outcome.value}
        if status:
            attributes["http.response.status_code"] = status
        span.set_attributes(attributes)
        first_at = attempt.tally.first_at
        if first_at is not None:
            span.add_event("first_token", timestamp=self._ns(first_at))
        if attempt.outcome is not Outcome.OK:
            message = error.message if isinstance(error, GatewayError) else attempt.outcome.value
            span.set_status(Status(StatusCode.ERROR, message))
        span.end(end_time=self._ns(self._clock()))

    def finish(self, record: AccessRecord, queue_wait_s: float) -> None:
        """The request was answered as ``record`` says."""
        if not self._recording:
            return
        end = self._clock()
        self._admitted(end)  # refused while waiting, or no worker at all
        attributes: dict[str, AttributeValue] = {
            "gen_ai.request.model": record.model,
            "http.response.status_code": record.status,
            "dflash.outcome": record.outcome.value,
            "dflash.stream": record.stream,
            "dflash.attempts": record.attempts,
            "dflash.queue_wait_s": queue_wait_s,
        }
        optional: dict[str, AttributeValue | None] = {
            "dflash.client_request_id": record.client_request_id,
            "dflash.key": record.key,
            "dflash.priority": record.priority,
            "dflash.worker": record.worker,
            "gen_ai.usage.input_tokens": record.prompt_tokens,
            "gen_ai.usage.output_tokens": record.completion_tokens,
            "dflash.reasoning_tokens": record.reasoning_tokens,
            "dflash.accept_length": record.accept_length,
            "dflash.ttft_ms": record.ttft_ms,
            "dflash.usage_estimated": True if record.usage_estimated else None,
        }
        attributes.update({k: v for k, v in optional.items() if v is not None})
        self._end(attributes, record.status, record.error, end)

    def refused(self, error: BaseException, key: str | None) -> None:
        """The request was answered with ``error`` before any worker was asked."""
        if not self._recording:
            return
        status = error.status if isinstance(error, GatewayError) else 500
        attributes: dict[str, AttributeValue] = {
            "http.response.status_code": status,
            "dflash.outcome": Outcome.REJECTED.value,
        }
        if key is not None:
            attributes["dflash.key"] = key
        message = error.message if isinstance(error, GatewayError) else "internal error"
        self._end(attributes, status, message, self._clock())

    def _end(
        self, attributes: dict[str, AttributeValue], status: int, error: str | None, end: float
    ) -> None:
        span = self._span
        span.set_attributes(attributes)
        if status >= 500:  # a server span's error: the gateway's or its workers' fault
            span.set_status(Status(StatusCode.ERROR, error))
        span.end(end_time=self._ns(end))
