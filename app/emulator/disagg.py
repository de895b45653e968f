"""Prefill/decode disaggregation, as SGLang 0.5.23 runs it (``--disaggregation-mode``).

A router sends the same body, with ``bootstrap_host``/``bootstrap_port``/``bootstrap_room``, to one
prefill server P and one decode server D at once, and relays D's answer. What each side does here
(``sglang/srt/disaggregation/``):

Prefill (``prefill.py``): the request waits in the bootstrap queue until D has sent its destination
for the room (``KVPoll.Bootstrapping`` -> ``WaitingForInput``), at most the bootstrap timeout
(``SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT``); then it is admitted and prefilled (the prefill time
of the prompt, at this worker's speed), its KV "transferred" (the room turns ``Success``) and the
client gets the one token the prefill sampled, ``finish_reason`` ``"length"``
(``FINISH_LENGTH(length=0)`` once the transfer is done). No verify step runs on P.

Decode (``decode.py``, ``common/conn.py`` ``CommonKVReceiver``): the request asks P's bootstrap
server for its parallel info (``GET /route`` with -1 ranks, then its rank; cached per bootstrap
address, retried once a second up to 15 times, then aborted), sends its destination for the room,
and waits until P reports the room ``Success``: at most the waiting timeout
(``SGLANG_DISAGGREGATION_WAITING_TIMEOUT``), after which it tells P to drop the room. A bootstrap
server that stops answering for ``heartbeat_max_failure`` tries ``heartbeat_interval`` apart fails
its rooms ("Lost connection with prefill instance"). Then the request runs its verify steps
exactly as on a whole worker (no prefill of its own).

Failures are answered as SGLang's scheduler aborts them (``prepare_abort`` with a status): 500 with
SGLang's message (streams: HTTP 200, one in-band error event, ``[DONE]``). A request without
``bootstrap_room`` is refused with 400 unless the transfer backend is ``fake`` (``scheduler.py``);
with ``fake`` nothing is exchanged (``fake/conn.py``: handshake and transfer succeed at once).
``/abort_request`` and a client that goes away end the request on either side; the room is then
failed on both (D notifies P, P's room fails D's wait).

The exchange between D and P that SGLang does over ZMQ (destination, status, abort notification)
is emulated over HTTP on P's bootstrap port: ``app.emulator.bootstrap``. The roles:
``app.emulator.prefill_role`` and ``app.emulator.decode_role`` (``app.emulator.roles`` picks one).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from app.emulator.engine import ActiveRequest, Clock
from app.emulator.rooms import RoomBook

if TYPE_CHECKING:
    from app.emulator.session import Session

MODES = ("null", "prefill", "decode")
# sglang/srt/arg_groups/choices.py DISAGG_TRANSFER_BACKEND_CHOICES
TRANSFER_BACKENDS = ("mooncake", "nixl", "ascend", "fake", "mori", "mooncake_tcp")
DEFAULT_BOOTSTRAP_PORT = 8998
# disaggregation/utils.py: requests for this host use the fake transfer (warm-up, health checks).
FAKE_BOOTSTRAP_HOST = "2.2.2.2"
# decode.py: ``_max_ensure_retries`` scheduling cycles, ``_ensure_retry_interval`` seconds apart.
ENSURE_RETRIES = 15
ENSURE_RETRY_INTERVAL_S = 1.0
# The longest one status query waits on P before D looks at its own deadline again.
POLL_WAIT_S = 1.0
ABORTED = "Aborted by AbortReq."

T = TypeVar("T")


@dataclass(frozen=True)
class DisaggConfig:
    """SGLang's ``--disaggregation-*`` flags and ``SGLANG_DISAGGREGATION_*`` timeouts."""

    mode: str = "null"
    bootstrap_port: int = DEFAULT_BOOTSTRAP_PORT
    transfer_backend: str = "mooncake"
    bootstrap_timeout_s: float = 300.0  # SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT
    waiting_timeout_s: float = 300.0  # SGLANG_DISAGGREGATION_WAITING_TIMEOUT
    heartbeat_interval_s: float = 5.0  # SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL
    heartbeat_max_failure: int = 2  # SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE

    def validate(self, http_port: int) -> None:
        if self.mode not in MODES:
            raise ValueError(f"unknown disaggregation mode {self.mode!r}; one of {MODES}")
        if self.transfer_backend not in TRANSFER_BACKENDS:
            raise ValueError(f"unknown transfer backend {self.transfer_backend!r}")
        if not 0 <= self.bootstrap_port < 65536:
            raise ValueError("disaggregation bootstrap port must be in 0..65535")
        if self.mode == "prefill" and self.bootstrap_port == http_port and http_port != 0:
            raise ValueError("the bootstrap port must differ from the HTTP port")
        for name in ("bootstrap_timeout_s", "waiting_timeout_s", "heartbeat_interval_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")
        if self.heartbeat_max_failure < 1:
            raise ValueError("heartbeat_max_failure must be >= 1")

    @property
    def enabled(self) -> bool:
        return self.mode != "null"


class TransferFailed(Exception):
    """The request is aborted with a status (SGLang's ``prepare_abort(req, message, status)``)."""

    def __init__(self, message: str, status: int = 500, stage: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.stage = stage  # bootstrap | transfer: SGLang's failure counter it counts in
        self.outcome = "failed"


def missing_room(rid: str) -> TransferFailed:
    """``scheduler.py``: a disaggregated request without a room, on a real transfer backend."""
    refused = TransferFailed(
        "Invalid request: Disaggregated request received without bootstrap room id. "
        f"req.rid={rid!r}",
        400,
    )
    refused.outcome = "refused"
    return refused


def kv_error(room: int, reason: str) -> str:
    return f"KVTransferError(bootstrap_room={room}): {reason}"


@dataclass
class RoomUse:
    """What one request did with its room (the record written when it finishes)."""

    room: int | None
    peer: str | None  # P's bootstrap address (on D) or D's address (on P)
    started: float
    transferred: float | None = None
    outcome: str | None = None  # set when it failed; else derived at the end
    reason: str | None = None


async def unless_aborted(active: ActiveRequest, work: Awaitable[T]) -> tuple[bool, T | None]:
    """Run ``work`` until it ends or the request is aborted: (aborted, result)."""
    task = asyncio.ensure_future(work)
    aborted = asyncio.ensure_future(active.wait_aborted())
    try:
        await asyncio.wait({task, aborted}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        aborted.cancel()
    if not task.done():
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return True, None
    return False, task.result()


class RoleSide:
    """What both roles share: the check of a request's fields, the room records, loads."""

    # The record's name for the other side of the room.
    peer_key = "peer"

    def __init__(self, config: DisaggConfig, clock: Clock) -> None:
        self.config = config
        self.clock = clock
        self.book = RoomBook(config.mode)
        self.last_transfer_ms = 0.0

    @property
    def fake(self) -> bool:
        return self.config.transfer_backend == "fake"

    def uses_transfer(self, session: Session) -> bool:
        return not self.fake and session.req.bootstrap_host != FAKE_BOOTSTRAP_HOST

    def check(self, session: Session) -> None:
        """SGLang's admission check of a disaggregated request (400 without a room)."""
        if session.req.bootstrap_room is None and not self.fake:
            raise missing_room(session.rid)

    def record(self, session: Session, use: RoomUse, extra: dict[str, Any]) -> None:
        aborted = session.active.aborted
        outcome = use.outcome
        if outcome is None:
            outcome = "aborted" if aborted else self._done_outcome(use)
        self.book.add(
            {
                "room": use.room,
                "role": self.config.mode,
                "rid": session.rid,
                self.peer_key: use.peer,
                "outcome": outcome,
                "reason": use.reason,
                "started": use.started,
                "transferred": use.transferred,
                "finished": self.clock.time(),
                **extra,
            }
        )

    def _done_outcome(self, use: RoomUse) -> str:
        raise NotImplementedError

    def loads(self) -> dict[str, Any]:
        raise NotImplementedError

    def pending(self) -> list[dict[str, Any]]:
        raise NotImplementedError

    async def close(self) -> None:
        return None
