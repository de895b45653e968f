"""OpenTelemetry traces of completion requests (``tracing.*`` settings, ``app.tracing.config``).

``make_tracing`` is the only way in: it returns None while tracing is off, and the request path
then does nothing more than test ``Gateway.tracer`` (and ``Job.trace``) for None. The SDK is
imported only when tracing is on (``app.tracing.otel``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from app.tracing.config import INSTALL_HINT, TracingConfig

if TYPE_CHECKING:
    from opentelemetry.sdk.trace.export import SpanExporter

    from app.tracing.otel import Tracing


def make_tracing(
    config: TracingConfig, *, clock: Callable[[], float], exporter: SpanExporter | None = None
) -> Tracing | None:
    """The process's tracer, or None when tracing is off. ``exporter`` replaces the configured
    one (e.g. an in-memory exporter). ``ConfigError`` if the SDK cannot be imported."""
    if not config.enabled:
        return None
    try:
        from app.tracing.otel import Tracing
    except ImportError as exc:
        from app.config import ConfigError

        raise ConfigError(f"tracing needs the OpenTelemetry SDK ({exc}): {INSTALL_HINT}") from None
    return Tracing(config, clock=clock, exporter=exporter)
