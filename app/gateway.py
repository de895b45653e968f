"""The composition root: everything ``create_app`` builds for one gateway process."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from app.accesslog import AccessLog
from app.auth.keystore import KeyStore
from app.config import Settings
from app.limits.per_key import Limiter
from app.metrics import Metrics
from app.proxy.forward import Proxy
from app.proxy.headers import FORWARDED
from app.tenants.quota import TokenQuotas
from app.tenants.tenant import Tenants
from app.workers.admission import Admission
from app.workers.pool import WorkerPool

if TYPE_CHECKING:
    from app.response_store.backends import ResponseStore
    from app.tracing.otel import Tracing


@dataclass(slots=True)
class Gateway:
    """Everything ``create_app`` builds for one process."""

    settings: Settings
    pool: WorkerPool
    proxy: Proxy
    admission: Admission  # the per-worker caps and the queue (the proxy's; read by ops)
    metrics: Metrics
    tenants: Tenants  # each key's policy: weight, priority class, quotas
    keys: KeyStore = field(default_factory=KeyStore)  # no keys: open
    limiter: Limiter | None = None  # per-key limits, when configured
    quota: TokenQuotas | None = None  # per-key token quotas, when a policy has one
    access: AccessLog = field(default_factory=AccessLog)  # the access log (one line per answer)
    draining: bool = False  # SIGTERM received: not ready (new requests served a little longer)
    accepting: bool = True  # False once the drain window closed: new requests get 503
    tracer: Tracing | None = None  # OpenTelemetry traces; None while tracing is off
    forward_headers: frozenset[bytes] = FORWARDED  # client headers that reach a worker
    responses: ResponseStore | None = None  # stored /v1/responses answers, when configured
