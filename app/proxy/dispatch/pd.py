"""Prefill/decode disaggregation on the request path (SGLang's PD protocol; docs/pd.md): the
``Dispatch`` of a fleet of prefill and decode workers (``Disaggregation``); each attempt's pair
is a ``Pair`` (``app.proxy.dispatch.pair``).

With ``pd.disaggregation`` on, each attempt goes to a pair: one decode worker D (picked among
those with room: decode capacity bounds concurrency) and one prefill worker P. The attempt's body
gets the three bootstrap fields that pair them, ``bootstrap_host`` (P's host),
``bootstrap_port`` (P's bootstrap port) and ``bootstrap_room`` (a random 63-bit number, new for
every attempt), and goes to both at once: P computes the prompt's KV cache and hands it to D in
the room, D waits for it, then decodes. D's answer is the client's (the ``Attempt`` relays it as
it would a whole worker's); P's is read to its end and thrown away in a task of its own
(``Pair``), never holding the client.

Failures: P failing before D's first data event ends D's attempt (aborted on D by its rid, no
verdict on D's breaker) with ``PrefillFailed``, which is retried on another pair like any failure
before the commit point; D failing, the client leaving, or a deadline ending the attempt cancels
P's side, which is aborted on P. D's first-byte deadline covers its wait for the room, so no
request leaves a decode waiting for a room nobody fills; while P has not answered, that deadline
is P's failure (``Pair.overdue``: P's timeout, no verdict on D, the retry avoids P). Once D
answered in full, P's side gets ``pd.prefill_drain_s`` more to finish; then it is aborted on P and
counted as P's timeout, so a prefill worker that takes requests and never finishes them holds no
socket, task or in-flight slot for long, and its breaker opens after
``breaker.failure_threshold`` of them (it is no longer picked).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any

from app.config import Settings
from app.metrics import Metrics
from app.proxy.dispatch import Job, continues_on
from app.proxy.dispatch.pair import Pair
from app.routing.policies import Policy, RoutingContext, make_policy, make_prefill_policy
from app.upstream.client import UpstreamClient
from app.workers.admission import Admission
from app.workers.pool import WorkerPool
from app.workers.worker import Worker

if TYPE_CHECKING:
    import random


Clock = Callable[[], float]
Spawn = Callable[[Coroutine[Any, Any, None]], None]
Abort = Callable[[Worker, str], Coroutine[Any, Any, None]]
ROOM_BITS = 63  # SGLang's bootstrap_room: a random non-negative 64-bit signed integer
_MAX_PREFILL_ANSWER = 1 << 20  # more than a prefill answer ever is: the rest is not read


class Disaggregation:
    """The PD ``Dispatch``: the two pools' picks and one ``Pair`` per attempt."""

    def __init__(
        self,
        settings: Settings,
        *,
        pool: WorkerPool,
        admission: Admission,
        client: UpstreamClient,
        metrics: Metrics,
        rng: random.Random,
        clock: Clock,
        spawn: Spawn,
        abort: Abort,
    ) -> None:
        config = settings.pd
        factor = settings.prefix_affinity_load_factor
        self.prefill_policy: Policy = make_prefill_policy(config.prefill_policy, load_factor=factor)
        self.decode_policy: Policy = make_policy(config.decode_policy, rng=rng, load_factor=factor)
        self._pool = pool
        self._admission = admission
        self._client = client
        self._metrics = metrics
        self._rng = rng
        self._clock = clock
        self._spawn = spawn
        self._abort = abort
        self._drain_s = settings.pd.prefill_drain_s
        self._answer_limit = min(_MAX_PREFILL_ANSWER, settings.limits.max_response_bytes)
        self.tasks: set[asyncio.Task[None]] = set()  # prefill sides still running

    async def aclose(self) -> None:
        """Let the prefill sides still draining finish (briefly) at shutdown."""
        if self.tasks:
            await asyncio.wait(self.tasks, timeout=2.0)

    def prefills(self, model: str, tried: set[str]) -> list[Worker]:
        """The prefill workers an attempt may use: routable, not yet tried by this request."""
        return [w for w in self._pool.available_as(model, "prefill") if w.name not in tried]

    def candidates(self, model: str, tried: set[str], *, continuing: bool = False) -> list[Worker]:
        """The decode workers an attempt may go to (admission keeps those with room): not yet
        tried, and only while some prefill worker may take the attempt's other half."""
        if not self.prefills(model, tried):
            return []
        return [w for w in self._pool.available_as(model, "decode") if w.name not in tried]

    def has_other(self, model: str, tried: set[str]) -> bool:
        return bool(self.candidates(model, tried))

    def can_continue(self, model: str, tried: set[str]) -> bool:
        return any(continues_on(w) for w in self.candidates(model, tried))

    def pick(self, ctx: RoutingContext, candidates: list[Worker]) -> Worker:
        return self.decode_policy.pick(ctx, candidates)

    def target(self, job: Job, worker: Worker, tried: set[str]) -> Pair | None:
        """The attempt's pair: ``worker`` (decode) and a prefill worker not yet tried (None:
        the last one left while the attempt queued)."""
        prefill = self.pick_prefill(job.ctx, tried)
        if prefill is None:
            return None
        return Pair(self, prefill, job.ctx.model, stream=job.stream, source=job.source)

    def pick_prefill(self, ctx: RoutingContext, tried: set[str]) -> Worker | None:
        prefills = self.prefills(ctx.model, tried)
        if not prefills:
            return None
        roomy = [w for w in prefills if self._admission.has_room(w)]
        return self.prefill_policy.pick(ctx, roomy or prefills)

    def new_room(self) -> int:
        return self._rng.getrandbits(ROOM_BITS)
