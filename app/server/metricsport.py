"""``/metrics`` on its own port (``metrics_port``), e.g. reachable by Prometheus inside the
cluster while the API port is public. When it is set, the API port answers 404 for /metrics.

The server shares the gateway's event loop and process; the gateway's uvicorn server owns the
signals and stops this one when it stops.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import orjson
import uvicorn

from app.api.ops import exposition
from app.errors import NotFound
from app.gateway import Gateway
from app.metrics import CONTENT_TYPE


def metrics_app(gateway: Gateway) -> Any:
    """A minimal ASGI app: ``GET /metrics`` and nothing else."""

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        if scope["path"] == "/metrics" and scope["method"] in ("GET", "HEAD"):
            status, ctype, body = 200, CONTENT_TYPE.encode(), exposition(gateway)
        else:
            status, ctype = 404, b"application/json"
            body = orjson.dumps(NotFound(f"no route for {scope['path']} here").body())
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [(b"content-type", ctype), (b"content-length", str(len(body)).encode())],
            }
        )
        await send(
            {"type": "http.response.body", "body": b"" if scope["method"] == "HEAD" else body}
        )

    return app


class MetricsServer(uvicorn.Server):
    def __init__(self, gateway: Gateway, log_config: dict[str, Any], log_level: str) -> None:
        config = uvicorn.Config(
            metrics_app(gateway),
            lifespan="off",
            access_log=False,
            log_config=log_config,
            log_level=log_level,
            http="httptools",
        )
        super().__init__(config)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # The gateway's server in the same loop handles SIGTERM/SIGINT (drain) and stops us.
        yield
