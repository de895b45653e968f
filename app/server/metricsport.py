"""``/metrics`` on its own port (``metrics_port``, bound to ``metrics_host``), e.g. reachable by
Prometheus inside the cluster while the API port is public. When it is set, the API port answers
404 for /metrics.

The port has the API port's guards (the same protocol class: header and body deadlines, header
size cap, connection cap, write deadline) and an access-log line per answer. It is Prometheus's:
open by default even when API keys are configured (``/metrics`` on the API port then needs a
key), and needs a Bearer key only when ``auth.protect_ops`` is set to true. The server shares the
gateway's event loop and process; the gateway's uvicorn server owns the signals and stops this one
when it stops.
"""

from __future__ import annotations

from typing import Any

import orjson
import uvicorn

from app.accesslog import AccessRecord
from app.api.ops import exposition
from app.door.api_keys import ops_key_of
from app.door.reject import NO_MODEL, REJECTED
from app.door.request_id import client_request_id_of, echo_id_of, request_id_of
from app.errors import GatewayError, MethodNotAllowed, NotFound
from app.gateway import Gateway
from app.metrics import CONTENT_TYPE, OTHER
from app.server.guard import GuardedConnection
from app.server.uvicorn.server import Server


def metrics_app(gateway: Gateway) -> Any:
    """A minimal ASGI app: ``GET /metrics`` and nothing else."""

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        request_id = request_id_of(scope)
        path, method = scope["path"], scope["method"]
        try:
            if path != "/metrics":
                raise NotFound(f"no route for {path} here")
            if method not in ("GET", "HEAD"):
                raise MethodNotAllowed(f"method {method} is not allowed on {path}")
            ops_key_of(gateway, scope["headers"], metrics_port=True)
            status, ctype, body = 200, CONTENT_TYPE.encode(), exposition(gateway)
            error = None
        except GatewayError as exc:
            error = exc
            status, ctype, body = exc.status, b"application/json", orjson.dumps(exc.body())
        record = AccessRecord(
            request_id, "/metrics" if path == "/metrics" else OTHER, NO_MODEL, False, status=status
        )
        record.client_request_id = client_request_id_of(scope)
        if error is not None:
            record.outcome, record.error = REJECTED, error.message
        gateway.access.emit(record)
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [
                    (b"content-type", ctype),
                    (b"content-length", str(len(body)).encode()),
                    (b"x-request-id", echo_id_of(scope).encode("ascii")),
                ],
            }
        )
        await send({"type": "http.response.body", "body": b"" if method == "HEAD" else body})

    return app


class MetricsServer(Server):
    # The gateway's server in the same loop handles SIGTERM/SIGINT (drain) and stops this one.
    owns_signals = False

    def __init__(
        self,
        gateway: Gateway,
        log_config: dict[str, Any],
        log_level: str,
        protocol: type[GuardedConnection],
    ) -> None:
        config = uvicorn.Config(
            metrics_app(gateway),
            lifespan="off",
            access_log=False,
            log_config=log_config,
            log_level=log_level,
            http=protocol,
        )
        super().__init__(config)
