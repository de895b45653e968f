"""``tracing.*`` settings (a section of ``app.config.Settings``): OpenTelemetry traces.

Off by default. On, every completion request gets a server span (parented on the client's W3C
``traceparent``/``tracestate`` when it sent them), a child span for its wait in the admission
queue and one per upstream attempt, whose context goes to the worker as ``traceparent``::

    tracing:
      enabled: true
      service_name: dflash-gateway
      exporter: otlp            # or console (one JSON document per span on stdout)
      otlp_endpoint: http://otel-collector:4318/v1/traces
      sample_ratio: 0.1         # of new traces; a client's sampled flag is followed

The spans are built and exported by the OpenTelemetry SDK, an optional install
(``pip install 'dflash-gateway[otel]'``): the gateway runs without it while tracing is off, and
refuses to start with tracing on and the SDK missing.
"""

from __future__ import annotations

import importlib.util
from typing import Literal

from pydantic import Field, field_validator

from app.sections import Section

INSTALL_HINT = "pip install 'dflash-gateway[otel]'"


def sdk_missing() -> str | None:
    """Why the OpenTelemetry SDK and OTLP exporter cannot be imported, or None if they can."""
    for module in ("opentelemetry.sdk.trace", "opentelemetry.exporter.otlp.proto.http"):
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):  # a parent package missing or unloadable
            found = False
        if not found:
            return (
                f"tracing needs the OpenTelemetry SDK ({module} is not installed): {INSTALL_HINT}"
            )
    return None


class TracingConfig(Section):
    """OpenTelemetry traces of the completion requests, exported over OTLP/HTTP (off by
    default; needs ``pip install 'dflash-gateway[otel]'``)."""

    # Record a trace of every completion request.
    enabled: bool = False
    service_name: str = Field("dflash-gateway", min_length=1)  # the spans' service.name
    # otlp: OTLP over HTTP/protobuf (no gRPC); console: each span as JSON on stdout.
    exporter: Literal["otlp", "console"] = "otlp"
    # The collector's full traces URL (e.g. http://collector:4318/v1/traces). None: the SDK's
    # OTEL_EXPORTER_OTLP_TRACES_ENDPOINT / OTEL_EXPORTER_OTLP_ENDPOINT (and their headers,
    # timeout, compression siblings) apply, else http://localhost:4318/v1/traces.
    otlp_endpoint: str | None = None
    # Share of new traces recorded. A request that carries a client's traceparent follows its
    # sampled flag instead (parent-based), so one trace is kept or dropped whole.
    sample_ratio: float = Field(1.0, ge=0.0, le=1.0)

    @field_validator("enabled")
    @classmethod
    def _sdk_installed(cls, enabled: bool) -> bool:
        missing = sdk_missing() if enabled else None
        if missing is not None:
            raise ValueError(missing)
        return enabled
