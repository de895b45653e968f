"""One attempt's prefill + decode pair (``Pair``): the ``Target`` of a PD attempt
(``app.proxy.dispatch.pd``, whose module doc says how the two sides fail and end)."""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from app.errors import UpstreamError, UpstreamStatusError, UpstreamStreamBroken
from app.outcomes import Outcome
from app.proxy.dispatch import Headers, Pieces
from app.upstream.client import UpstreamResponse, map_transport_error
from app.upstream.errors import TransportError
from app.workers.worker import Worker

if TYPE_CHECKING:
    from app.proxy.attempt import Attempt
    from app.proxy.dispatch.pd import Disaggregation

log = logging.getLogger(__name__)


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
        self, pd: Disaggregation, prefill: Worker, model: str, *, stream: bool, source: str | None
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

    def outgoing(self, attempt: Attempt, path: str, body: Pieces, headers: Headers) -> Pieces:
        """D's body and P's: the attempt's, with the bootstrap fields ahead of its closing
        ``"rid"`` piece; P's side starts here, in a task of its own."""
        self.bind(attempt)
        body = (*body[:-1], self._fields, body[-1])
        pd = self._pd
        self.sent_at = pd._clock()
        task = self._task = asyncio.get_running_loop().create_task(
            self._prefill(path, body, headers)
        )
        pd.tasks.add(task)
        task.add_done_callback(pd.tasks.discard)
        return body

    def _sent(self) -> None:
        self._written = True

    async def _prefill(self, path: str, body: Pieces, headers: Headers) -> None:
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
