"""``dflash-gateway serve``: the gateway under uvicorn (uvloop + httptools, TCP_NODELAY), with
deadlines and a size cap for request headers and bodies and a cap on open connections
(``app.server.guard``).

With no worker source configured (``Settings.embedded_default``) the emulated workers are
started first and stopped last, whatever ends the server: Ctrl-C, SIGTERM or an error.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import shlex
import signal
import socket
import sys
from pathlib import Path
from typing import Any

import orjson
import uvicorn

from app.accesslog import configure_logging
from app.config import Settings
from app.door.reject import refusals
from app.gateway import Gateway
from app.main import create_app
from app.model_names import is_pattern
from app.server.embedded import EmbeddedStartError, EmbeddedWorkers
from app.server.guard import GuardedConnection, GuardLimits, guarded_protocol
from app.server.metricsport import MetricsServer
from app.server.processes import ProcessGroup
from app.server.uvicorn.server import Server
from app.sockets import listen, listen_shared
from app.surfaces import ROUTES, shape_of
from app.tenants.usage import process_path

log = logging.getLogger(__name__)


def curl_example(base_url: str, model: str) -> str:
    """The README's streamed-answer command, as it shows it (one argument a line), for
    ``base_url`` and ``model``."""
    name = orjson.dumps(model).decode()
    body = (
        f'{{"model": {name}, "stream": true,\n'
        '       "messages": [{"role": "user", "content": "Why is the sky blue?"}]}'
    )
    return (
        f"curl -N {base_url}/v1/chat/completions \\\n"
        "  -H 'Content-Type: application/json' \\\n"
        f"  -d {shlex.quote(body)}"
    )


def _banner(settings: Settings, port: int, workers: list[str]) -> str:
    host = "127.0.0.1" if settings.host in ("0.0.0.0", "::", "") else settings.host
    base = f"http://{host}:{port}"
    model = settings.embedded.model
    aliases = [a for a, t in settings.model_aliases.items() if t == model and not is_pattern(a)]
    lines = [f"dflash-gateway: serving on {base}"]
    if workers:
        if settings.pd.disaggregation:
            lines[0] += f" in PD mode: emulated prefill {workers[0]}, decode {workers[1]}"
        else:
            lines[0] += f" in front of {len(workers)} emulated workers ({', '.join(workers)})"
        lines += ["Try it:", curl_example(base, aliases[0] if aliases else model)]
        if "claude-*" in settings.model_aliases:
            lines.append(f"  ANTHROPIC_BASE_URL={base} ANTHROPIC_AUTH_TOKEN=any claude")
        lines.append("Ctrl-C stops the gateway and its workers.")
    return "\n".join(lines)


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def serve(settings: Settings, *, metrics_dir: Path | None = None) -> int:
    """Run until Ctrl-C or SIGTERM. ``metrics_dir``: prometheus_client's multiprocess directory
    when ``settings.processes > 1`` (``__main__`` creates and removes it)."""
    log_config = configure_logging(settings.log_level, json=settings.log_json)
    # SIGTERM behaves like Ctrl-C (uvicorn shuts down gracefully, then re-raises it here).
    signal.signal(signal.SIGTERM, _interrupt)
    embedded = (
        EmbeddedWorkers(settings.embedded, pd=settings.pd.disaggregation)
        if settings.embedded_default
        else None
    )
    try:
        with contextlib.ExitStack() as stack:
            workers: list[str] = []
            if embedded is not None:
                stack.enter_context(embedded)
                workers = embedded.start()
                if settings.pd.disaggregation:  # the first is the prefill worker
                    prefill = f"{workers[0]} {embedded.bootstrap_port}"
                    pd = settings.pd.model_copy(
                        update={"prefill": [prefill], "decode": workers[1:]}
                    )
                    settings = settings.model_copy(update={"pd": pd})
                else:
                    settings = settings.model_copy(update={"worker_urls": workers})
            if settings.processes > 1:
                socks = listen_shared(settings.host, settings.port, settings.processes)
                msocks = (
                    listen_shared(settings.metrics_host, settings.metrics_port, settings.processes)
                    if settings.metrics_port is not None
                    else None
                )
                banner = _banner(settings, socks[0].getsockname()[1], workers)

                def process(index: int) -> None:
                    own = per_process(settings, index)
                    server = _server(own, log_config, msocks[index] if msocks else None)
                    _run(server, socks[index], banner if index == 0 else None)

                group = ProcessGroup(
                    settings.processes,
                    process,
                    # The drain (accept window + in-flight streams), then a little slack.
                    stop_timeout_s=settings.drain_accept_s + settings.drain_s + 5,
                    metrics_dir=metrics_dir,
                )
                log.info("%d gateway processes on one port", settings.processes)
                group.run()
                return 0
            sock = listen(settings.host, settings.port)
            msock = (
                listen(settings.metrics_host, settings.metrics_port)
                if settings.metrics_port is not None
                else None
            )
            banner = _banner(settings, sock.getsockname()[1], workers)
            _run(_server(settings, log_config, msock), sock, banner)
    except KeyboardInterrupt:
        return 0
    except EmbeddedStartError as exc:
        print(f"dflash-gateway: {exc}", file=sys.stderr)
        return 1
    return 0


def per_process(settings: Settings, index: int) -> Settings:
    """Gateway process ``index``'s settings under ``--processes N``: its own usage log file."""
    path = settings.tenants.usage_log
    if path is None:
        return settings
    tenants = settings.tenants.model_copy(update={"usage_log": process_path(path, index)})
    return settings.model_copy(update={"tenants": tenants})


def guarded(gateway: Gateway, settings: Settings) -> type[GuardedConnection]:
    """The gateway's httptools protocol: offers the relay's direct lane and refuses slow,
    oversized and surplus connections, counting each refusal in ``gateway``'s metrics and
    access log (and each client cut off for not reading its response)."""
    limits = GuardLimits(
        header_s=settings.timeouts.client_header_s,
        body_s=settings.timeouts.client_body_s,
        max_header_bytes=settings.limits.max_header_bytes,
        max_connections=settings.limits.max_connections,
        retry_after_s=settings.admission.retry_after_s,
        max_pipelined=settings.limits.max_pipelined,
        write_s=settings.timeouts.client_write_s,
    )
    return guarded_protocol(
        limits,
        refusals(gateway, ROUTES),
        gateway.metrics.record_client_write_timeout,
        shape_of,
    )


def uvicorn_config(
    app: Any,
    protocol: type[GuardedConnection],
    settings: Settings,
    log_config: dict[str, Any] | None = None,
) -> uvicorn.Config:
    """The gateway app under uvicorn as ``serve`` runs it: ``protocol`` (``guarded``), lifespan
    on, no access log, ``X-Forwarded-*`` ignored."""
    return uvicorn.Config(
        app,
        http=protocol,
        # ASGI 3, said rather than guessed: the gateway's app returns its coroutine from a plain
        # __call__ (app.api.asgi), which uvicorn's guess would take for ASGI 2.
        interface="asgi3",
        lifespan="on",
        access_log=False,
        # X-Forwarded-* would only rewrite scope["client"], which the gateway never reads.
        proxy_headers=False,
        log_config=log_config,
        log_level=settings.log_level,
        timeout_graceful_shutdown=max(1, round(settings.drain_s)),
        timeout_keep_alive=max(1, round(settings.timeouts.client_keepalive_s)),
    )


def _server(
    settings: Settings, log_config: dict[str, Any], metrics_sock: socket.socket | None = None
) -> uvicorn.Server:
    """One process's gateway app under uvicorn (and its metrics port, when configured)."""
    app = create_app(settings)
    gateway: Gateway = app.state.gateway
    protocol = guarded(gateway, settings)
    config = uvicorn_config(app, protocol, settings, log_config)
    metrics = None
    if metrics_sock is not None:
        metrics = (MetricsServer(gateway, log_config, settings.log_level, protocol), metrics_sock)
    return DrainingServer(config, gateway, settings.drain_accept_s, metrics)


class DrainingServer(Server):
    """uvicorn, with SIGTERM as a graceful drain instead of an immediate stop.

    The first SIGTERM marks the gateway draining (``/readyz`` → 503) and keeps serving new
    requests for ``accept_s``; then new requests get 503, the listener closes and uvicorn waits
    up to ``timeout_graceful_shutdown`` (``drain_s``) for in-flight streams. The process exits 0.
    A second signal, or Ctrl-C, stops at once as usual."""

    def __init__(
        self,
        config: uvicorn.Config,
        gateway: Gateway,
        accept_s: float,
        metrics: tuple[MetricsServer, socket.socket] | None = None,
    ) -> None:
        super().__init__(config)
        self._gateway = gateway
        self._accept_s = accept_s
        self._metrics = metrics
        self._loop: asyncio.AbstractEventLoop | None = None

    def intercept(self, sig: int) -> bool:
        loop = self._loop
        if sig == signal.SIGTERM and not self._gateway.draining and loop is not None:
            self._gateway.draining = True
            log.info("SIGTERM: draining; new requests accepted for %.1f s", self._accept_s)
            loop.call_soon_threadsafe(loop.call_later, self._accept_s, self._stop_accepting)
            return True
        return False

    def _stop_accepting(self) -> None:
        log.info("drain: no new requests; waiting for in-flight ones to finish")
        self._gateway.accepting = False
        self.should_exit = True

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        companion: asyncio.Task[None] | None = None
        if self._metrics is not None:
            metrics_server, metrics_sock = self._metrics
            companion = asyncio.create_task(metrics_server.serve(sockets=[metrics_sock]))
        try:
            await super().serve(sockets=sockets)
        finally:
            if companion is not None and self._metrics is not None:
                self._metrics[0].should_exit = True
                await companion


def _run(server: uvicorn.Server, sock: socket.socket, banner: str | None) -> None:
    async def main() -> None:
        task = asyncio.create_task(server.serve(sockets=[sock]))
        # uvicorn offers no "started" event to wait on; poll its flag.
        while not server.started and not task.done():  # noqa: ASYNC110
            await asyncio.sleep(0.02)
        if server.started:
            # Everything built at start-up lives as long as the process: keep it out of the
            # cyclic collector's full passes, which otherwise rescan it all under load.
            gc.freeze()
            if banner:
                print(banner, flush=True)
        await task

    try:
        import uvloop

        loop_factory: Any = uvloop.new_event_loop
    except ImportError:  # pragma: no cover - uvicorn[standard] brings it
        loop_factory = None
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        runner.run(main())
