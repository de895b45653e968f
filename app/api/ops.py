"""Operational endpoints: liveness, readiness, Prometheus metrics, the worker table (read-only),
and the reachability probes coding agents send before their first request (``HEAD /``,
``HEAD /api/hello``: Claude Code's), answered 200 with no body.

Probes never need an API key; ``/metrics`` and ``/workers`` do when API keys are configured, unless
``auth.protect_ops`` is false (``app.door.api_keys.ops_key_of``).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from starlette.responses import JSONResponse, Response

from app.api.deps import GatewayDep
from app.api.security import OpsKey
from app.errors import NotFound
from app.gateway import Gateway
from app.metrics import CONTENT_TYPE

router = APIRouter(include_in_schema=False)


@router.get("/livez")
async def livez() -> dict[str, str]:
    return {"status": "ok"}


@router.head("/")
@router.head("/api/hello")
async def reachable() -> Response:
    return Response(status_code=200)


@router.get("/readyz")
@router.get("/health")
async def readyz(gw: GatewayDep) -> Response:
    healthy = sum(1 for w in gw.pool.workers if w.routable)
    ready = healthy > 0 and not gw.draining
    body = {
        "status": "ready" if ready else ("draining" if gw.draining else "no_healthy_worker"),
        "healthy_workers": healthy,
        "workers": len(gw.pool.workers),
    }
    return JSONResponse(body, status_code=200 if ready else 503)


def exposition(gw: Gateway) -> bytes:
    """The Prometheus text: request metrics plus the pool's state read at scrape time."""
    workers, admission = gw.pool.workers, gw.admission
    gw.metrics.observe_pool(workers, admission.depth, admission.saturation(workers))
    return gw.metrics.render()


@router.get("/metrics", dependencies=[OpsKey])
async def metrics(gw: GatewayDep) -> Response:
    if gw.settings.metrics_port is not None:
        raise NotFound(f"metrics are served on port {gw.settings.metrics_port}")
    return Response(exposition(gw), media_type=CONTENT_TYPE)


@router.get("/workers", dependencies=[OpsKey])
async def workers(gw: GatewayDep) -> dict[str, Any]:
    pd = gw.proxy.pd
    return {
        "policy": gw.settings.policy,
        # Prefill/decode disaggregation (docs/pd.md): its policies and the prefill sides running.
        "pd": None
        if pd is None
        else {
            "prefill_policy": pd.prefill_policy.name,
            "decode_policy": pd.decode_policy.name,
            "prefill_sides_running": len(pd.tasks),
        },
        "draining": gw.draining,
        "queued": gw.admission.depth,
        "saturation": gw.admission.saturation(gw.pool.workers),
        "workers": [
            {
                "name": w.name,
                "url": w.url,
                "role": w.role,
                "bootstrap_port": w.bootstrap_port,
                "engine": w.engine_name,
                "state": w.state.value,
                "routable": w.routable,
                "breaker": w.breaker.state.name.lower(),
                "models": list(w.models),
                "in_flight": w.in_flight,
                "capacity": {
                    "admission_cap": gw.admission.cap(w),
                    "max_running_requests": w.load.max_running_requests,
                    "max_total_num_tokens": w.load.max_total_num_tokens,
                    "context_length": w.context_length,
                },
                "load": {
                    "running": w.load.running,
                    "waiting": w.load.waiting,
                    "waiting_tokens": w.load.waiting_tokens,
                    "token_usage": w.load.token_usage,
                    "gen_throughput": w.load.gen_throughput,
                    "per_request_rate": w.rate,
                    "accept_length": w.load.accept_length,
                    "accept_rate": w.load.accept_rate,
                },
                # Measured by the gateway on this worker's requests (collapse detection).
                "accept_length": w.accept.ewma,
                "accept_samples": w.accept.samples,
                "collapsed": w.accept.collapsed,
            }
            for w in gw.pool.workers
        ],
    }
