"""The gateway as a process with tracing on, exporting over OTLP/HTTP to a collector stand-in on
loopback: a request's spans arrive as protobuf, on the client's trace, under the configured
service name, and spans still buffered when the gateway stops are sent before it exits."""

from __future__ import annotations

import gzip
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from tests.support.procs import PYTHON, ProcessManager

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
TRACEPARENT = f"00-{TRACE_ID}-b7ad6b7169203331-01"
MODEL = "moonshotai/Kimi-K2.5"


class Collector(ThreadingHTTPServer):
    """Takes OTLP/HTTP protobuf exports on 127.0.0.1 and keeps them."""

    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Export)
        self.paths: list[str] = []
        self.exports: list[ExportTraceServiceRequest] = []

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/v1/traces"

    def spans(self) -> list[tuple[str, str, str]]:
        """(service.name, span name, trace id) of every span received."""
        out = []
        for export in list(self.exports):
            for resource in export.resource_spans:
                attrs = {a.key: a.value.string_value for a in resource.resource.attributes}
                for scope in resource.scope_spans:
                    for span in scope.spans:
                        out.append((attrs["service.name"], span.name, span.trace_id.hex()))
        return out


class _Export(BaseHTTPRequestHandler):
    server: Collector

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["content-length"]))
        if self.headers.get("content-encoding") == "gzip":
            body = gzip.decompress(body)
        export = ExportTraceServiceRequest()
        export.ParseFromString(body)
        self.server.paths.append(self.path)
        self.server.exports.append(export)
        self.send_response(200)
        self.send_header("content-type", "application/x-protobuf")
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def collector() -> Iterator[Collector]:
    server = Collector()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def test_spans_reach_an_otlp_collector_and_are_flushed_at_exit(
    procs: ProcessManager, collector: Collector
) -> None:
    emulator = procs.start(
        [PYTHON, "-m", "app", "emulate", "--port", "{port}", "--speed", "20"], name="emu"
    )
    env = {
        "DFLASH_GATEWAY_TRACING__ENABLED": "true",
        "DFLASH_GATEWAY_TRACING__SERVICE_NAME": "gateway-under-test",
        "DFLASH_GATEWAY_TRACING__OTLP_ENDPOINT": collector.endpoint,
        "DFLASH_GATEWAY_HEALTH__INTERVAL_S": "0.3",
        # Far longer than the test: only the exit's flush can send these spans.
        "OTEL_BSP_SCHEDULE_DELAY": "600000",
    }
    gateway = procs.start(
        [PYTHON, "-m", "app", "serve", "--port", "{port}", "--worker-url", emulator.url],
        name="gateway",
        ready_path="/readyz",
        ready_status=200,
        env=env,
    )
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 8,
        "stream": True,
    }
    with httpx.stream(
        "POST",
        gateway.url + "/v1/chat/completions",
        json=body,
        headers={"traceparent": TRACEPARENT},
        timeout=30,
    ) as response:
        text = response.read().decode()
    assert response.status_code == 200 and text.endswith("data: [DONE]\n\n")
    assert not collector.exports  # still buffered
    assert gateway.stop() == 0
    assert collector.paths and set(collector.paths) == {"/v1/traces"}
    spans = collector.spans()
    assert {name for _, name, _ in spans} == {"POST /v1/chat/completions", "admission", "attempt"}
    assert {(service, trace) for service, _, trace in spans} == {("gateway-under-test", TRACE_ID)}
