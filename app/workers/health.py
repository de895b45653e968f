"""Active health checks: ``GET /health`` on every worker each ``health.interval_s``.

A worker becomes HEALTHY after ``success_threshold`` consecutive 200s and once its models are
known (``GET /v1/models``), with its engine settled (``app.workers.engines``: configured, or
detected now) and its capacity read first (SGLang's ``/v1/loads``: ``max_running_requests`` and
``max_total_num_tokens`` per rank; vLLM's ``max_num_seqs``; the model card's ``max_model_len``);
a worker still loading answers 503 and stays STARTING, so it gets no traffic. A HEALTHY worker
turns UNHEALTHY after ``failure_threshold`` consecutive failures. DRAINING is owned by discovery
and left alone. Load polls go through the worker's engine too.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from app.errors import UpstreamError
from app.upstream.client import UpstreamClient
from app.workers.config import HealthConfig, WorkersConfig
from app.workers.engines import MAX_COUNT, Engine, detect, make_engine, parse_loads
from app.workers.pool import WorkerPool
from app.workers.worker import Worker, WorkerState

__all__ = ["MAX_COUNT", "HealthChecker", "parse_loads"]

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Streak:
    successes: int = 0
    failures: int = 0


class HealthChecker:
    def __init__(
        self,
        pool: WorkerPool,
        client: UpstreamClient,
        config: HealthConfig,
        workers: WorkersConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._pool = pool
        self._client = client
        self._config = config
        self._workers = workers or WorkersConfig()
        self._clock = clock
        self._streaks: dict[str, _Streak] = {}
        self._kicked = asyncio.Event()
        self._misroled: set[str] = set()  # PD workers running another role (logged once)

    def kick(self) -> None:
        """Check again now (membership changed), not at the next interval."""
        self._kicked.set()

    async def run(self) -> None:
        """Check every worker now, then every interval (or when kicked), until cancelled."""
        while True:
            self._kicked.clear()
            await self.check_all()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._kicked.wait(), self._config.interval_s)

    async def poll_loads(self) -> None:
        """Refresh every worker's load, and so its capacity (a restarted worker may come back with
        other limits), through its engine every ``loads_interval_s``."""
        while True:
            await asyncio.gather(
                *(
                    self.poll_load(w)
                    for w in self._pool.workers
                    if w.state is not WorkerState.STARTING
                )
            )
            await asyncio.sleep(self._config.loads_interval_s)

    async def poll_load(self, worker: Worker) -> None:
        load = await self._engine(worker).poll_load(self._client, worker, self._config.timeout_s)
        if load is not None:
            worker.set_load(load)

    def _engine(self, worker: Worker) -> Engine:
        """The worker's engine; until it is settled at admission, the configured or pinned one
        (SGLang under ``auto``)."""
        if worker.engine is None:
            name = worker.engine_pin or self._workers.engine
            worker.engine = self._make(name if name != "auto" else "sglang")
        return worker.engine

    def _make(self, name: str) -> Engine:
        return make_engine(
            "vllm" if name == "vllm" else "sglang",
            vllm_max_num_seqs=self._workers.vllm_max_num_seqs,
            clock=self._clock,
        )

    async def _settle_engine(self, worker: Worker) -> Engine | None:
        """At admission: the pinned or configured engine, else the one the worker answers as
        (None: it did not answer; not admitted this time)."""
        name: str = worker.engine_pin or self._workers.engine
        if name == "auto":
            found = await detect(self._client, worker, self._config.timeout_s)
            if found is None:
                return None
            name = found
        if worker.engine is None or worker.engine.name != name:
            worker.engine = self._make(name)
        await worker.engine.admit(self._client, worker, self._config.timeout_s)
        return worker.engine

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(w) for w in self._pool.workers))

    async def check(self, worker: Worker) -> None:
        streak = self._streaks.setdefault(worker.name, _Streak())
        ok = await self._probe(worker)
        if ok:
            streak.successes += 1
            streak.failures = 0
        else:
            streak.failures += 1
            streak.successes = 0
        if worker.state is WorkerState.DRAINING:
            return
        if worker.state is WorkerState.HEALTHY:
            if streak.failures >= self._config.failure_threshold:
                log.warning("worker %s failed %d health checks", worker.name, streak.failures)
                worker.state = WorkerState.UNHEALTHY
        elif (
            ok
            and streak.successes >= self._config.success_threshold
            and await self._discover(worker)
            and (engine := await self._settle_engine(worker)) is not None
            and await self._runs_its_role(worker)
        ):
            await self.poll_load(worker)  # its capacity, before it takes a request
            log.info(
                "worker %s (%s) is healthy, serving %s, capacity %d",
                worker.name,
                engine.name,
                ", ".join(worker.models),
                worker.capacity,
            )
            worker.state = WorkerState.HEALTHY
            worker.accept.reset()  # a restarted (perhaps rolled-back) worker is judged afresh

    async def _runs_its_role(self, worker: Worker) -> bool:
        """A prefill or decode worker is admitted only when it runs that role (SGLang's
        ``/server_info`` ``disaggregation_mode``): a decode server listed as a prefill one would
        fail every pair. Whole workers are not asked."""
        if worker.role == "whole":
            return True
        try:
            status, data = await self._client.get(worker, "/server_info", self._config.timeout_s)
        except UpstreamError:
            return False
        mode = data.get("disaggregation_mode") if isinstance(data, dict) else None
        if status == 200 and mode == worker.role:
            self._misroled.discard(worker.name)
            return True
        if worker.name not in self._misroled:
            self._misroled.add(worker.name)
            log.error(
                "worker %s is listed as a %s worker but its /server_info says "
                "disaggregation_mode %r (HTTP %d): not admitted",
                worker.name,
                worker.role,
                mode,
                status,
            )
        return False

    async def _probe(self, worker: Worker) -> bool:
        return await self._engine(worker).healthy(self._client, worker, self._config.timeout_s)

    async def _discover(self, worker: Worker) -> bool:
        try:
            status, data = await self._client.get(worker, "/v1/models", self._config.timeout_s)
        except UpstreamError:
            return False
        cards = data.get("data") if isinstance(data, dict) else None
        if status != 200 or not isinstance(cards, list):
            return False
        self._pool.set_models(worker, [c for c in cards if isinstance(c, dict)])
        return bool(worker.models)
