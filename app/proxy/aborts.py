"""Aborts on the workers, and the background tasks they run in (``Aborts``): an attempt that
failed or was abandoned is aborted on its worker without holding its request up."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any

from app.metrics import Metrics
from app.upstream.client import UpstreamClient
from app.workers.worker import Worker

log = logging.getLogger(__name__)


class Aborts:
    """``abort`` an attempt on its worker; ``spawn`` runs one (or a PD prefill side's) in the
    background; ``aclose`` lets them finish, briefly, at shutdown."""

    def __init__(self, client: UpstreamClient, metrics: Metrics) -> None:
        self._client = client
        self._metrics = metrics
        self._background: set[asyncio.Task[Any]] = set()

    async def aclose(self) -> None:
        if self._background:
            await asyncio.wait(self._background, timeout=2.0)

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def abort(self, worker: Worker, rid: str) -> None:
        """Abort an attempt on its worker through the worker's engine (SGLang: a call; vLLM:
        nothing to send, the attempt's closed connection is the abort)."""
        engine = worker.engine
        if engine is not None and not engine.abort_by_call:
            return
        self._metrics.record_abort()
        if engine is None:  # not yet admitted: SGLang's call, as before engines
            acknowledged = await self._client.abort(worker, rid)
        else:
            acknowledged = await engine.abort(self._client, worker, rid)
        if not acknowledged:
            log.info("abort of %s on %s was not acknowledged", rid, worker.name)
