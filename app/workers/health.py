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
# No worker (or its ranks summed) runs, queues or holds more than this many requests or tokens, or
# generates this many tokens a second; a larger figure is a broken or hostile worker's, and would
# overflow an int conversion or drive the fleet saturation (the autoscaling signal) to absurd
# values.
MAX_COUNT = 1 << 31


def _count(value: object) -> int | None:
    """A count the worker reported: a finite number from 0 to ``MAX_COUNT``, else None."""
    number = _num(value, -1.0)
    return int(number) if 0 <= number <= MAX_COUNT else None


def _summed(ranks: list[dict[str, object]], field: str) -> int:
    """``field`` summed over the ranks that report it plausibly; 0 if the sum is not."""
    total = sum(c for c in (_count(r.get(field)) for r in ranks) if c is not None)
    return total if total <= MAX_COUNT else 0


def _capacity(ranks: list[dict[str, object]], field: str) -> int | None:
    """A limit summed over the ranks, None (unknown) unless every rank reports a plausible,
    positive one and their sum is plausible too."""
    counts = [_count(r.get(field)) for r in ranks]
    limits = [c for c in counts if c is not None and c > 0]
    if len(limits) < len(counts) or sum(limits) > MAX_COUNT:
        return None
    return sum(limits)


def parse_loads(data: object) -> WorkerLoad | None:
    """SGLang's ``/v1/loads`` document summed over data-parallel ranks (one rank with DFLASH).

    Every figure is taken only when finite and plausible, per rank and summed: counts from 0 to
    ``MAX_COUNT``, token usage a fraction, throughput from 0 to ``MAX_COUNT`` tokens/s; an
    implausible one counts as not reported (0; a capacity unknown, so the default cap applies)."""
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
    usage = [u for u in (_num(r.get("token_usage")) for r in ranks) if 0 <= u <= 1]
    gen = sum(t for t in (_num(r.get("gen_throughput")) for r in ranks) if 0 <= t <= MAX_COUNT)
    return WorkerLoad(
        running=_summed(ranks, "num_running_reqs"),
        waiting=_summed(ranks, "num_waiting_reqs"),
        token_usage=max(usage, default=0.0),
        gen_throughput=gen if gen <= MAX_COUNT else 0.0,
        accept_length=sum(accept) / len(accept) if accept else None,
        accept_rate=sum(rates) / len(rates) if rates else None,
        max_running_requests=_capacity(ranks, "max_running_requests"),
        max_total_num_tokens=_capacity(ranks, "max_total_num_tokens"),
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
