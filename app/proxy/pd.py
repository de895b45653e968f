"""Prefill/decode disaggregation on the request path (SGLang's PD protocol; docs/pd.md).

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
import logging
from collections.abc import Callable, Coroutine, Sequence
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from app.config import Settings
from app.errors import UpstreamError, UpstreamStatusError, UpstreamStreamBroken
from app.metrics import Metrics
from app.outcomes import Outcome
from app.routing.policies import Policy, RoutingContext, make_policy, make_prefill_policy
from app.upstream.client import UpstreamClient, UpstreamResponse, map_transport_error
from app.upstream.client import Worker as Upstream
from app.upstream.errors import TransportError
from app.workers.admission import Admission
from app.workers.pool import WorkerPool
from app.workers.worker import Worker

if TYPE_CHECKING:
    import random

    from app.proxy.attempt import Attempt

log = logging.getLogger(__name__)
Clock = Callable[[], float]
Spawn = Callable[[Coroutine[Any, Any, None]], None]
Abort = Callable[[Worker, str], Coroutine[Any, Any, None]]
Body = Callable[[str, "int | None"], tuple["memoryview | bytes", ...]]
ROOM_BITS = 63  # SGLang's bootstrap_room: a random non-negative 64-bit signed integer
_MAX_PREFILL_ANSWER = 1 << 20  # more than a prefill answer ever is: the rest is not read


class PrefillFailed(UpstreamError):
    """The attempt's prefill worker failed before its decode worker answered: the decode side
    was aborted; another pair may be tried."""

    code = "prefill_failed"
    retryable = True
    attempt_outcome = Outcome.CANCELLED
    public = "the prefill worker failed while serving the request"


def bootstrap_host(url: str) -> str:
    """The host of a prefill worker's URL as SGLang's decode side dials it (IPv6 in brackets)."""
    host = urlsplit(url).hostname or ""
    return f"[{host}]" if ":" in host else host


class Disaggregation:
    """The PD side of the ``Proxy``: the two pools' picks and one ``Pair`` per attempt."""

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

    def candidates(self, model: str, tried: set[str]) -> list[Worker]:
        """The decode workers an attempt may go to (admission keeps those with room): not yet
        tried, and only while some prefill worker may take the attempt's other half."""
        if not self.prefills(model, tried):
            return []
        return [w for w in self._pool.available_as(model, "decode") if w.name not in tried]

    def pick_prefill(self, ctx: RoutingContext, tried: set[str]) -> Worker | None:
        prefills = self.prefills(ctx.model, tried)
        if not prefills:
            return None
        roomy = [w for w in prefills if self._admission.has_room(w)]
        return self.prefill_policy.pick(ctx, roomy or prefills)

    def pair(self, prefill: Worker, *, model: str, stream: bool, source: str | None = None) -> Pair:
        return Pair(self, prefill, model=model, stream=stream, source=source)

    def new_room(self) -> int:
        return self._rng.getrandbits(ROOM_BITS)


class Pair:
    """One attempt's prefill side, and what ties it to the decode side's ``Attempt``."""

    __slots__ = (
        "_attempt",
        "_chunks_at_bind",
        "_decode_closed",
        "_drained",
        "_fields",
        "_overdue",
        "_pd",
        "_source",
        "_task",
        "_written",
        "failed",
        "kv_recorded",
        "model",
        "prefill",
        "prefill_done",
        "room",
        "sent_at",
        "stream",
    )

    def __init__(
        self,
        pd: Disaggregation,
        prefill: Worker,
        *,
        model: str,
        stream: bool,
        source: str | None = None,
    ) -> None:
        self._pd = pd
        self.prefill = prefill
        self.model = model
        self.stream = stream
        self._source = source
        self.room = pd.new_room()
        port = prefill.bootstrap_port
        self._fields = b'"bootstrap_host":"%s","bootstrap_port":%s,"bootstrap_room":%d,' % (
            bootstrap_host(prefill.url).encode("ascii"),
            b"null" if port is None else b"%d" % port,
            self.room,
        )
        self._attempt: Attempt | None = None
        self._chunks_at_bind: int | None = None  # a continuation leg's chunks relayed before it
        self._task: asyncio.Task[None] | None = None
        self._written = False
        self._decode_closed = False
        self._overdue = False  # D's deadline passed while P kept its room empty: P's fault
        self._drained = False  # D answered, P did not finish within pd.prefill_drain_s: P's fault
        self.failed: UpstreamError | None = None  # how the prefill side failed, if it did
        self.sent_at: float | None = None  # both sides started
        self.prefill_done: float | None = None  # P's answer read to its end
        self.kv_recorded = False

    def body(self, parts: Body) -> Body:
        """``parts`` with the bootstrap fields ahead of its closing ``"rid"`` piece."""
        fields = self._fields

        def with_bootstrap(rid: str, priority: int | None) -> tuple[memoryview | bytes, ...]:
            pieces = parts(rid, priority)
            return (*pieces[:-1], fields, pieces[-1])

        return with_bootstrap

    def bind(self, attempt: Attempt) -> None:
        """The decode side's attempt (its rid is the prefill side's too)."""
        self._attempt = attempt
        attempt.partner = self.overdue
        if attempt.committed:  # a continuation leg: its stream's commit point is inherited
            self._chunks_at_bind = len(attempt.tally.chunk_times)

    def overdue(self) -> UpstreamError | None:
        """D's deadline passed (``Attempt.end``): the prefill worker's fault when D has relayed
        nothing and P has not answered yet (its room may never be filled), so the attempt fails
        with ``PrefillFailed`` (no verdict on D; a retry avoids P) and P's side, cancelled,
        counts as P's timeout. None (D's own timeout) once P answered in full."""
        attempt, task = self._attempt, self._task
        if (
            attempt is None
            or task is None
            or task.done()
            or self.prefill_done is not None
            or not self._decode_waits(attempt)
        ):
            return None
        self._overdue = True
        self.failed = PrefillFailed(f"prefill worker {self.prefill.name} did not answer in time")
        return self.failed

    def _decode_waits(self, attempt: Attempt) -> bool:
        """D has relayed nothing of this attempt yet: it may still be waiting for the room."""
        if not attempt.committed:
            return True
        bound = self._chunks_at_bind
        return bound is not None and len(attempt.tally.chunk_times) == bound

    async def open(
        self,
        worker: Upstream,
        path: str,
        body: bytes | Sequence[bytes | memoryview],
        headers: list[tuple[bytes, bytes]],
        sent: Callable[[], None] | None = None,
        fresh: bool = False,
    ) -> UpstreamResponse:
        """Send the body to P (in a task of its own) and to D (``worker``); D's response, as
        ``UpstreamClient.open`` returns it."""
        pd = self._pd
        self.sent_at = pd._clock()
        task = self._task = asyncio.get_running_loop().create_task(
            self._prefill(path, (body,) if isinstance(body, bytes) else tuple(body), headers)
        )
        pd.tasks.add(task)
        task.add_done_callback(pd.tasks.discard)
        return await pd._client.open(worker, path, body, headers, sent=sent, fresh=fresh)

    def _sent(self) -> None:
        self._written = True

    async def _prefill(
        self, path: str, body: tuple[bytes | memoryview, ...], headers: list[tuple[bytes, bytes]]
    ) -> None:
        """P's side: send, read its answer to the end and drop it; a failure ends D's attempt
        unless D already committed; cancelled (D failed or finished, the client left), P is
        aborted by the attempt's rid."""
        pd, worker = self._pd, self.prefill
        attempt = self._attempt
        assert attempt is not None
        outcome = Outcome.CANCELLED
        guard = worker.attempt_guard(self._source)
        verdict = guard.__enter__()
        try:
            try:
                response = await pd._client.open(worker, path, body, headers, sent=self._sent)
                try:
                    await self._drain(response)
                except TransportError as exc:
                    raise map_transport_error(exc, worker, committed=False) from None
                finally:
                    response.discard()
            except UpstreamError as exc:
                outcome = exc.attempt_outcome
                answered = isinstance(exc, UpstreamStatusError)
                verdict.fault = not answered or exc.status >= 500
                verdict.requested = answered
                self.failed = exc
                log.info("prefill side of %s failed on %s: %s", attempt.rid, worker.name, exc)
                if self._written and not answered:
                    pd._spawn(pd._abort(worker, attempt.rid))
                if self._decode_waits(attempt) and not self._decode_closed:
                    # P refused the request itself (a 4xx): so would any pair; else another
                    # pair may serve it.
                    refused = answered and exc.status < 500
                    await attempt.fail(
                        exc if refused else PrefillFailed(f"prefill worker {worker.name}: {exc}")
                    )
                return
            except asyncio.CancelledError:
                if self._overdue or self._drained:  # D waited, or answered, and P never did
                    outcome, verdict.fault = Outcome.TIMEOUT, True
                if self._drained:
                    log.info(
                        "prefill side of %s on %s did not finish %gs after its decode side",
                        attempt.rid,
                        worker.name,
                        pd._drain_s,
                    )
                if self._written:
                    pd._spawn(pd._abort(worker, attempt.rid))
                raise
            outcome, verdict.fault = Outcome.OK, False
            self.prefill_done = pd._clock()
            self.record_kv_wait()
        finally:
            guard.__exit__(None, None, None)
            pd._metrics.record_attempt(worker.name, outcome)

    async def _drain(self, response: UpstreamResponse) -> None:
        """Read P's answer and drop it: a stream must end with ``[DONE]`` and carry no error
        event (SGLang's prefill server answers like a whole one)."""
        limit = self._pd._answer_limit
        size = 0
        tail = b""
        error = False
        async for part in response.aiter_raw():
            size += len(part)
            if self.stream:
                window = tail + part
                error = error or b'data: {"error"' in window
                tail = window[-64:]
            if size > limit:
                raise UpstreamStreamBroken(f"prefill worker {self.prefill.name}: answer too large")
        if self.stream and (error or b"data: [DONE]" not in tail):
            raise UpstreamStreamBroken(
                f"prefill worker {self.prefill.name}: "
                + ("an error event" if error else "the stream ended without [DONE]")
            )

    def close(self, attempt: Attempt) -> None:
        """The decode side ended: P's side is cancelled (aborted on P) unless D answered in
        full, in which case it has ``pd.prefill_drain_s`` more to finish (``_drain_over``)."""
        self._decode_closed = True
        task = self._task
        if task is None or task.done():
            self.record_kv_wait()
            return
        if attempt.outcome is Outcome.OK:
            timer = task.get_loop().call_later(self._pd._drain_s, self._drain_over)
            task.add_done_callback(lambda _: timer.cancel())
        else:
            task.cancel()

    def _drain_over(self) -> None:
        """P's side did not finish in its time after D answered: cancelled, it is aborted on P
        and counted as P's timeout."""
        task = self._task
        if task is not None and not task.done():
            self._drained = True
            task.cancel()

    def record_kv_wait(self) -> None:
        """The KV-transfer wait, once both ends are known: from both sides sent to D's first
        data event, less P's own time (streams only)."""
        attempt = self._attempt
        if self.kv_recorded or attempt is None or not self.stream:
            return
        first, done, sent = attempt.tally.first_at, self.prefill_done, self.sent_at
        if first is None or done is None or sent is None:
            return
        self.kv_recorded = True
        self._pd._metrics.record_kv_wait(self.model, max(0.0, first - done))

    def blame(self, tried: set[str], decode: Worker) -> None:
        """After a failed attempt: the worker a retry avoids is the side that failed (P when
        its failure ended D's attempt, else D, already in ``tried``)."""
        attempt = self._attempt
        if self.failed is not None and attempt is not None and attempt.outcome is Outcome.CANCELLED:
            tried.discard(decode.name)
            tried.add(self.prefill.name)
