"""Traces of requests through the gateway, on real sockets against scripted workers, collected
by the OpenTelemetry SDK's in-memory exporter: the server span on the client's trace, its
admission and attempt children, the context each worker receives, and nothing at all when
tracing is off."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from tests.support.gateway import MODEL, FakeWorker, GatewayHarness, wait_for

CHAT = "/v1/chat/completions"
TRACE_ID = 0x0AF7651916CD43DD8448EB211C80319C
PARENT_ID = 0xB7AD6B7169203331
CLIENT = {
    "traceparent": f"00-{TRACE_ID:032x}-{PARENT_ID:016x}-01",
    "tracestate": "vendor=abc",
}
ON = {"tracing": {"enabled": True}}


def chat(**extra: object) -> dict[str, object]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **extra}


def traceparent(span: ReadableSpan) -> str:
    """What a worker receives as the traceparent of ``span``'s children."""
    ctx = span.context
    assert ctx is not None
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"


def sampled_flag(header: str) -> bool:
    return bool(int(header.rsplit("-", 1)[1], 16) & 1)


class Trace:
    """The finished spans of one request, by their server span."""

    def __init__(self, server: ReadableSpan, spans: list[ReadableSpan]) -> None:
        assert server.context is not None
        self.server = server
        self.children = [
            s for s in spans if s.parent and s.parent.span_id == server.context.span_id
        ]

    def named(self, name: str) -> list[ReadableSpan]:
        return sorted((s for s in self.children if s.name == name), key=lambda s: s.start_time or 0)

    def attr(self, name: str) -> Any:
        assert self.server.attributes is not None
        return self.server.attributes.get(name)


async def traces(exporter: InMemorySpanExporter, count: int) -> list[Trace]:
    """The traces of ``count`` requests, once their server spans ended (just after the answer)."""

    def servers() -> list[ReadableSpan]:
        return [s for s in exporter.get_finished_spans() if s.kind is SpanKind.SERVER]

    await wait_for(lambda: len(servers()) >= count)
    spans = list(exporter.get_finished_spans())
    return [Trace(server, spans) for server in servers()]


async def test_a_stream_is_traced_on_the_clients_trace_and_its_worker_joins_it() -> None:
    exporter, worker = InMemorySpanExporter(), FakeWorker()
    async with GatewayHarness([worker], span_exporter=exporter, **ON) as gw:
        ex = await gw.post(CHAT, chat(stream=True), headers=CLIENT)
        (request,) = await traces(exporter, 1)
    assert ex.status == 200
    server = request.server
    assert server.name == "POST /v1/chat/completions"
    assert server.context is not None and server.context.trace_id == TRACE_ID
    assert server.parent is not None and server.parent.span_id == PARENT_ID
    assert server.parent.is_remote
    assert request.attr("dflash.request_id") == ex.headers["x-request-id"]
    assert request.attr("http.route") == CHAT
    assert request.attr("gen_ai.request.model") == MODEL
    assert request.attr("http.response.status_code") == 200
    assert request.attr("dflash.outcome") == "ok"
    assert request.attr("dflash.attempts") == 1
    assert request.attr("gen_ai.usage.input_tokens") == 7
    assert request.attr("gen_ai.usage.output_tokens") == 3
    assert request.attr("dflash.priority") == "normal"
    assert server.status.status_code is StatusCode.UNSET

    (admission,) = request.named("admission")
    (attempt,) = request.named("attempt")
    assert admission.attributes is not None and admission.attributes["dflash.queue_wait_s"] == 0
    assert attempt.kind is SpanKind.CLIENT
    assert attempt.attributes is not None
    assert attempt.attributes["dflash.worker"] == worker.name
    assert attempt.attributes["dflash.rid"] == worker.requests[0]["rid"]
    assert attempt.attributes["dflash.outcome"] == "ok"
    assert attempt.attributes["http.response.status_code"] == 200
    (first_token,) = attempt.events
    assert first_token.name == "first_token"
    # One timeline: queue, then the attempt, its first token inside it, all inside the request.
    assert server.start_time is not None and server.end_time is not None
    assert attempt.start_time is not None and attempt.end_time is not None
    assert admission.end_time is not None
    assert server.start_time <= admission.end_time <= attempt.start_time
    assert attempt.start_time <= first_token.timestamp <= attempt.end_time <= server.end_time

    sent = worker.headers[0]
    assert sent["traceparent"] == traceparent(attempt)  # the client's trace, the attempt's span
    assert sent["tracestate"] == "vendor=abc"


@pytest.mark.parametrize("client", [{}, {"traceparent": "00-not-a-trace-01"}])
async def test_a_request_without_a_valid_traceparent_starts_a_trace(client: dict[str, str]) -> None:
    exporter, worker = InMemorySpanExporter(), FakeWorker()
    async with GatewayHarness([worker], span_exporter=exporter, **ON) as gw:
        ex = await gw.post(CHAT, chat(), headers=client)
        (request,) = await traces(exporter, 1)
    assert ex.status == 200
    assert request.server.parent is None
    (attempt,) = request.named("attempt")
    assert worker.headers[0]["traceparent"] == traceparent(attempt)
    assert "tracestate" not in worker.headers[0]


async def test_a_retried_request_has_an_attempt_span_per_worker() -> None:
    exporter = InMemorySpanExporter()
    bad, good = FakeWorker(fail_status=503), FakeWorker()
    async with GatewayHarness(
        [bad, good], policy="round_robin", span_exporter=exporter, **ON
    ) as gw:
        for _ in range(2):  # round robin: one of them meets the failing worker first
            assert (await gw.post(CHAT, chat(stream=True), headers=CLIENT)).status == 200
        found = await traces(exporter, 2)
    retried = next(t for t in found if t.attr("dflash.attempts") == 2)
    failed, answered = retried.named("attempt")
    assert len(retried.named("admission")) == 2
    assert failed.attributes is not None and answered.attributes is not None
    assert failed.attributes["dflash.worker"] == bad.name
    assert failed.attributes["dflash.outcome"] == "status_error"
    assert failed.attributes["http.response.status_code"] == 503
    assert failed.status.status_code is StatusCode.ERROR
    assert not failed.events
    assert answered.attributes["dflash.worker"] == good.name
    assert answered.attributes["dflash.outcome"] == "ok"
    assert [e.name for e in answered.events] == ["first_token"]
    assert retried.attr("dflash.worker") == good.name
    assert traceparent(failed) in [h["traceparent"] for h in bad.headers]
    assert traceparent(answered) in [h["traceparent"] for h in good.headers]
    assert failed.context is not None and answered.context is not None
    assert failed.context.trace_id == answered.context.trace_id == TRACE_ID


async def test_the_admission_span_holds_the_queue_wait() -> None:
    exporter, worker = InMemorySpanExporter(), FakeWorker(hold_after=1)
    settings: dict[str, Any] = {"admission": {"per_worker_cap": 1}, **ON}
    async with GatewayHarness([worker], span_exporter=exporter, **settings) as gw:
        first = asyncio.ensure_future(gw.post(CHAT, chat(stream=True)))
        await worker.held.wait()
        queued = asyncio.ensure_future(gw.post(CHAT, chat(stream=True)))
        await wait_for(lambda: gw.gateway.admission.depth == 1)
        worker.release.set()
        assert [(await r).status for r in (first, queued)] == [200, 200]
        found = await traces(exporter, 2)
    waits = sorted(t.attr("dflash.queue_wait_s") for t in found)
    assert waits[0] == 0 and waits[1] > 0
    for request in found:
        (admission,) = request.named("admission")
        assert admission.attributes is not None
        assert admission.attributes["dflash.queue_wait_s"] == request.attr("dflash.queue_wait_s")


async def test_a_request_refused_in_the_queue_has_an_admission_span_and_no_attempt() -> None:
    exporter, worker = InMemorySpanExporter(), FakeWorker(hold_after=1)
    admission = {"per_worker_cap": 1, "queue_timeout_s": 0.1}
    async with GatewayHarness([worker], span_exporter=exporter, admission=admission, **ON) as gw:
        first = asyncio.ensure_future(gw.post(CHAT, chat(stream=True)))
        await worker.held.wait()
        refused = await gw.post(CHAT, chat(stream=True), headers=CLIENT)
        worker.release.set()
        assert (await first).status == 200
        found = await traces(exporter, 2)
    assert refused.status == 503
    (request,) = [t for t in found if t.attr("http.response.status_code") == 503]
    assert request.attr("dflash.outcome") == "no_capacity"
    assert request.server.status.status_code is StatusCode.ERROR
    assert len(request.named("admission")) == 1 and not request.named("attempt")


async def test_a_request_refused_at_the_door_is_a_span_on_the_clients_trace() -> None:
    exporter, worker = InMemorySpanExporter(), FakeWorker()
    keys = {"api_keys": ["team:sk-team-0123456789abcdef"]}
    async with GatewayHarness([worker], span_exporter=exporter, **keys, **ON) as gw:
        ex = await gw.post(CHAT, chat(), headers=CLIENT)
        (request,) = await traces(exporter, 1)
    assert ex.status == 401
    assert request.server.context is not None and request.server.context.trace_id == TRACE_ID
    assert request.attr("http.response.status_code") == 401
    assert request.attr("dflash.outcome") == "rejected"
    assert request.server.status.status_code is StatusCode.UNSET  # the client's fault
    assert not request.children and not worker.requests


async def test_the_messages_route_is_traced_through_the_same_door() -> None:
    exporter, worker = InMemorySpanExporter(), FakeWorker()
    body = {"model": MODEL, "max_tokens": 16, "messages": [{"role": "user", "content": "Hi"}]}
    async with GatewayHarness([worker], span_exporter=exporter, **ON) as gw:
        ex = await gw.post("/v1/messages", {**body, "stream": True}, headers=CLIENT)
        (request,) = await traces(exporter, 1)
    assert ex.status == 200
    assert request.server.name == "POST /v1/messages"
    (attempt,) = request.named("attempt")
    assert [e.name for e in attempt.events] == ["first_token"]
    assert worker.headers[0]["traceparent"] == traceparent(attempt)


async def test_sampling_follows_the_clients_flag_and_the_ratio_for_new_traces() -> None:
    exporter, worker = InMemorySpanExporter(), FakeWorker()
    tracing = {"enabled": True, "sample_ratio": 0.0}
    async with GatewayHarness([worker], span_exporter=exporter, tracing=tracing) as gw:
        assert (await gw.post(CHAT, chat())).status == 200  # a new trace: not sampled
        unsampled = {"traceparent": f"00-{TRACE_ID:032x}-{PARENT_ID:016x}-00"}
        assert (await gw.post(CHAT, chat(), headers=unsampled)).status == 200
        assert (await gw.post(CHAT, chat(), headers=CLIENT)).status == 200  # sampled upstream
        (request,) = await traces(exporter, 1)
    assert request.server.context is not None and request.server.context.trace_id == TRACE_ID
    # Unrecorded requests still pass a context on, marked not sampled, so workers agree.
    new, kept, sampled = (h["traceparent"] for h in worker.headers)
    assert not sampled_flag(new) and f"{TRACE_ID:032x}" not in new
    assert kept.startswith(f"00-{TRACE_ID:032x}-") and not sampled_flag(kept)
    assert f"{PARENT_ID:016x}" not in kept  # the gateway's span, not the client's
    assert sampled == traceparent(request.named("attempt")[0])
    assert len(exporter.get_finished_spans()) == 3  # the sampled request's spans only


async def test_with_tracing_off_the_clients_context_reaches_the_worker_untouched() -> None:
    exporter, worker = InMemorySpanExporter(), FakeWorker()
    async with GatewayHarness([worker], span_exporter=exporter) as gw:
        assert gw.gateway.tracer is None
        ex = await gw.post(CHAT, chat(stream=True), headers=CLIENT)
    assert ex.status == 200
    assert worker.headers[0]["traceparent"] == CLIENT["traceparent"]
    assert worker.headers[0]["tracestate"] == CLIENT["tracestate"]
    assert not exporter.get_finished_spans()
