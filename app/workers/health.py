"""Active health checks: ``GET /health`` on every worker each ``health.interval_s``.

A worker becomes HEALTHY after ``success_threshold`` consecutive 200s and once its models are
known (``GET /v1/models``), with its capacity read first (``/v1/loads``: ``max_running_requests``
and ``max_total_num_tokens`` per rank; the model card's ``max_model_len``); a worker still
loading answers 503 and stays STARTING, so it gets no traffic. A HEALTHY worker turns UNHEALTHY
after ``failure_threshold`` consecutive failures. DRAINING is owned by discovery and left alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from dataclasses import dataclass

from app.config import HealthConfig
from app.errors import UpstreamError
from app.upstream.client import UpstreamClient
from app.workers.pool import WorkerPool
from app.workers.worker import Worker, WorkerLoad, WorkerState

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Streak:
    successes: int = 0
    failures: int = 0


def _num(value: object, default: float = 0.0) -> float:
    """A finite number the worker reported, else ``default`` (a string, a bool, an int too large
    for a float, NaN or an infinity)."""
    if not isinstance(value, int | float) or isinstance(value, bool):
        return default
    try:
        number = float(value)
    except OverflowError:
        return default
    return number if math.isfinite(number) else default


# Plausible per-worker speculative figures: an acceptance length counts the accepted draft tokens
# plus the bonus token of each verify step (at least 1, at most a draft block and then some); an
# acceptance rate is a fraction. Anything else would poison the estimates built on them.
_ACCEPT_LENGTH = (1.0, 64.0)


def parse_loads(data: object) -> WorkerLoad | None:
    """SGLang's ``/v1/loads`` document summed over data-parallel ranks (one rank with DFLASH)."""
    ranks = data.get("loads") if isinstance(data, dict) else None
    if not isinstance(ranks, list) or not ranks:
        return None
    ranks = [r for r in ranks if isinstance(r, dict)]
    if not ranks:
        return None
    spec = [r.get("speculative") for r in ranks if isinstance(r.get("speculative"), dict)]
    low, high = _ACCEPT_LENGTH
    accept = [a for a in (_num(s.get("accept_length")) for s in spec) if low <= a <= high]
    rates = [r for r in (_num(s.get("accept_rate")) for s in spec) if 0 < r <= 1]
    caps = [int(_num(r.get("max_running_requests"))) for r in ranks]
    tokens = [int(_num(r.get("max_total_num_tokens"))) for r in ranks]
    return WorkerLoad(
        running=int(sum(_num(r.get("num_running_reqs")) for r in ranks)),
        waiting=int(sum(_num(r.get("num_waiting_reqs")) for r in ranks)),
        token_usage=max(_num(r.get("token_usage")) for r in ranks),
        gen_throughput=sum(_num(r.get("gen_throughput")) for r in ranks),
        accept_length=sum(accept) / len(accept) if accept else None,
        accept_rate=sum(rates) / len(rates) if rates else None,
        max_running_requests=sum(caps) if all(c > 0 for c in caps) else None,
        max_total_num_tokens=sum(tokens) if all(t > 0 for t in tokens) else None,
    )


class HealthChecker:
    def __init__(self, pool: WorkerPool, client: UpstreamClient, config: HealthConfig) -> None:
        self._pool = pool
        self._client = client
        self._config = config
        self._streaks: dict[str, _Streak] = {}
        self._kicked = asyncio.Event()

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
        other limits), from ``/v1/loads`` every ``loads_interval_s``."""
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
        try:
            status, data = await self._client.get(
                worker, "/v1/loads?include=core,spec", self._config.timeout_s
            )
        except UpstreamError:
            return  # the health check decides what a silent worker means
        if status == 200:
            load = parse_loads(data)
            if load is not None:
                worker.set_load(load)

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
        ):
            await self.poll_load(worker)  # its capacity, before it takes a request
            log.info(
                "worker %s is healthy, serving %s, capacity %d",
                worker.name,
                ", ".join(worker.models),
                worker.capacity,
            )
            worker.state = WorkerState.HEALTHY
            worker.accept.reset()  # a restarted (perhaps rolled-back) worker is judged afresh

    async def _probe(self, worker: Worker) -> bool:
        try:
            status, _ = await self._client.get(worker, "/health", self._config.timeout_s)
        except UpstreamError:
            return False
        return status == 200

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
