"""Application factory: ``create_app(settings)`` builds everything and hangs it on ``app.state``:
the gateway (``Gateway``), the door every POST of the surface registry goes through
(``app.door``, ahead of FastAPI) and FastAPI's app for the rest."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI
from starlette.middleware.cors import CORSMiddleware

from app import __version__
from app.accesslog import AccessLog
from app.api import openai, ops, responses
from app.api import surfaces as api_surfaces
from app.api.access import AccessMiddleware
from app.api.asgi import ASGI, GatewayApp
from app.api.errors import install_handlers
from app.api.schema import openapi_document
from app.auth.keystore import KeyStore
from app.background import DEFAULT_BACKOFF, Backoff, supervise
from app.config import Settings
from app.door.entrance import BuildChecks, Door, checks
from app.door.request_id import RequestIdMiddleware
from app.gateway import Gateway
from app.limits.per_key import make_limiter, redis_store
from app.metrics import Metrics
from app.proxy.forward import Proxy
from app.proxy.headers import forwarded
from app.response_store.backends import make_store
from app.routing.cache_aware import CacheAware
from app.routing.policies import make_policy
from app.routing.shared_homes import SessionHomes
from app.surfaces import BY_PATH, ROUTES, SURFACES
from app.tenants.headers import RATE_LIMIT_HEADERS
from app.tenants.quota import make_quotas
from app.tenants.tenant import Tenants
from app.tenants.usage import UsageLog
from app.tracing import make_tracing
from app.upstream.client import UpstreamClient
from app.workers.acceptance import CollapseDetector
from app.workers.admission import Admission
from app.workers.discovery import make_discovery
from app.workers.health import HealthChecker
from app.workers.kv_counters import KvEventCounters
from app.workers.kv_events import KvEventSink, KvEventSinks
from app.workers.kv_subscriber import KvEventSubscriber
from app.workers.pool import EndpointLike, WorkerPool

if TYPE_CHECKING:
    from opentelemetry.sdk.trace.export import SpanExporter

log = logging.getLogger(__name__)


def create_app(
    settings: Settings,
    *,
    clock: Callable[[], float] = time.monotonic,
    rng: random.Random | None = None,
    span_exporter: SpanExporter | None = None,
    backoff: Backoff = DEFAULT_BACKOFF,
    door_checks: BuildChecks = checks,
) -> GatewayApp:
    """Build the gateway. ``clock`` and ``rng`` are the time and randomness sources (rids, backoff
    jitter, random policies); ``span_exporter`` takes the spans instead of the configured
    exporter when tracing is on; ``backoff``: the waits before a crashed background task is
    restarted (``app.background``); ``door_checks``: the door's checks
    (``app.door.entrance.checks``) for this gateway."""
    rng = rng or random.Random()
    access = AccessLog()
    pool = WorkerPool(breaker=settings.breaker, clock=clock)
    client = UpstreamClient(settings)
    metrics = Metrics(routes=ROUTES)
    keys = KeyStore([k.get_secret_value() for k in settings.api_keys], settings.auth.keys_file)
    usage = UsageLog.from_config(
        settings.tenants,
        metrics.record_usage_log_dropped,
        lambda: metrics.record_task_restart("usage"),
    )
    if usage is not None:  # the billable requests' records, also as usage lines
        access.sink = usage.sink(ROUTES, lambda: keys.open)
    admission = Admission(
        settings.admission,
        processes=settings.processes,
        clock=clock,
        deweight_collapsed=settings.routing.deweight_collapsed,
    )
    proxy = Proxy(
        settings=settings,
        pool=pool,
        policy=make_policy(
            settings.policy,
            rng=rng,
            load_factor=settings.prefix_affinity_load_factor,
            on_decision=functools.partial(metrics.record_routing_decision, settings.policy),
        ),
        client=client,
        metrics=metrics,
        access_log=access,
        clock=clock,
        rng=rng,
        admission=admission,
        acceptance=CollapseDetector(settings.routing, lambda: pool.workers),
    )
    health = HealthChecker(pool, client, settings.health, settings.workers, clock=clock)
    discovery = make_discovery(
        settings.discovery,
        settings.worker_urls,
        pd=settings.pd if settings.pd.disaggregation else None,
    )
    limiter = make_limiter(
        settings.limits, clock, on_store_error=lambda: metrics.record_limit_store_error("requests")
    )
    quota = make_quotas(
        settings.tenants,
        settings.limits,
        on_store_error=lambda: metrics.record_limit_store_error("tokens"),
    )
    gateway = Gateway(
        settings=settings,
        pool=pool,
        proxy=proxy,
        admission=admission,
        metrics=metrics,
        tenants=Tenants(settings.tenants),
        keys=keys,
        limiter=limiter,
        quota=quota,
        access=access,
        tracer=make_tracing(settings.tracing, clock=clock, exporter=span_exporter),
        forward_headers=forwarded(settings.limits.forward_headers),
        responses=make_store(settings.responses, settings.limits.redis_url),
    )

    # The workers' KV events (kv_events.enabled): counted per worker for operators, and fed to
    # cache_aware's index.
    kv_subscriber: KvEventSubscriber | None = None
    if settings.kv_events.enabled:

        def name_of(url: str) -> str | None:
            return next((w.name for w in pool.workers if w.url == url), None)

        sinks: list[KvEventSink] = [KvEventCounters(metrics, name_of)]
        if isinstance(proxy.learns, CacheAware):  # its prefix index follows the evictions
            sinks.append(proxy.learns.index)
        kv_subscriber = KvEventSubscriber(settings.kv_events, KvEventSinks(sinks))

    # cache_aware with replicas: where each session's history lives, shared through the Redis
    # the limits use (docs/routing.md).
    homes: SessionHomes | None = None
    if isinstance(proxy.learns, CacheAware) and settings.limits.redis_url:
        store, errors = redis_store(settings.limits.redis_url, timeout_s=0.5)
        homes = proxy.learns.homes = SessionHomes(
            store, errors, on_error=lambda: metrics.record_limit_store_error("session_homes")
        )

    def publish_keys() -> None:
        for name in keys.names():
            metrics.add_key(name)

    publish_keys()

    def publish(endpoints: Sequence[EndpointLike]) -> None:
        pool.reconcile(endpoints)
        for worker in pool.workers:
            metrics.add_worker(worker.name, worker.role)
        health.kick()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        def start(name: str, run: Callable[[], Awaitable[None]]) -> asyncio.Task[None]:
            """A background task, restarted (after a backoff) whenever it crashes."""
            supervised = supervise(name, run, metrics.record_task_restart, backoff=backoff)
            return asyncio.create_task(supervised, name=name)

        tasks = [
            start("discovery", lambda: discovery.run(publish)),
            start("health", health.run),
            start("loads", health.poll_loads),
        ]
        if metrics.multiprocess:  # --processes N: this process's gauges, for the others' scrapes
            tasks.append(
                start(
                    "metrics",
                    lambda: metrics.keep_fresh(
                        lambda: pool.workers,
                        lambda: admission.depth,
                        saturation=lambda: admission.saturation(pool.workers),
                    ),
                )
            )
        if kv_subscriber is not None:
            subscriber = kv_subscriber
            tasks.append(
                start("kv_events", lambda: subscriber.run(lambda: [w.url for w in pool.workers]))
            )
        if settings.auth.keys_file is not None:
            reload_s = settings.auth.reload_s
            tasks.append(start("keys", lambda: keys.watch(reload_s, publish_keys)))
        if keys.open:
            log.warning("no API keys configured: anyone who can reach the gateway may use it")
        try:
            yield
        finally:
            gateway.draining = True
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            await proxy.aclose()
            await client.aclose()
            if homes is not None:
                await homes.aclose()
            if limiter is not None:
                await limiter.close()
            if quota is not None:
                await quota.close()
            if gateway.responses is not None:
                await gateway.responses.close()
            if usage is not None:  # the lines still queued, with a bounded wait
                await asyncio.to_thread(usage.close)
            if gateway.tracer is not None:  # exports the spans still buffered
                await asyncio.to_thread(gateway.tracer.shutdown)

    app = FastAPI(
        title="dflash-gateway",
        version=__version__,
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url="/openapi.json",
        # A trailing slash is a 404 like any unknown path: a redirect would be built from the
        # client's Host header, and clients of this API use its exact paths.
        redirect_slashes=False,
    )
    bodies = [model for entry in SURFACES for model in entry.operation.models]
    app.openapi = lambda: openapi_document(app, settings, bodies)  # type: ignore[method-assign]
    app.state.settings = settings
    app.state.gateway = gateway
    app.state.kv_subscriber = kv_subscriber
    install_handlers(app)
    app.add_middleware(RequestIdMiddleware)
    cors: Callable[[ASGI], ASGI] | None = None
    if settings.cors_origins:  # off by default: browsers get no CORS headers at all
        options: dict[str, Any] = {
            "allow_origins": settings.cors_origins,
            "allow_methods": ["GET", "POST", "DELETE"],
            "allow_headers": [
                "authorization",
                "content-type",
                "x-request-id",
                "x-session-id",
                "x-api-key",
                "anthropic-version",
                "anthropic-beta",
            ],
            "expose_headers": ["x-request-id", "retry-after", *RATE_LIMIT_HEADERS],
            "max_age": 600,
        }
        app.add_middleware(CORSMiddleware, **options)  # FastAPI's routes and every preflight

        def cors(door: ASGI) -> ASGI:  # the door's POSTs, on the same path as without CORS
            return CORSMiddleware(door, **options)

    app.add_middleware(AccessMiddleware, gateway=gateway, routes=ROUTES)
    door = Door(gateway, door_checks)
    app.include_router(api_surfaces.router(door, SURFACES))
    app.include_router(openai.router)
    app.include_router(responses.router)  # GET/DELETE /v1/responses/{id}: the stored responses
    app.include_router(ops.router)
    return GatewayApp(app, door, BY_PATH, wrap=cors)
