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
is emulated over HTTP on P's bootstrap port: ``app.emulator.bootstrap``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import httpx

from app.emulator.engine import ActiveRequest, Clock
from app.emulator.rooms import KVPoll, Room, RoomBook, RoomTable

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


def _kv_error(room: int, reason: str) -> str:
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


async def _unless_aborted(active: ActiveRequest, work: Awaitable[T]) -> tuple[bool, T | None]:
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


class _Side:
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


class PrefillSide(_Side):
    """P: the room table its bootstrap server serves, and each request's wait and transfer."""

    peer_key = "decode"

    def __init__(self, config: DisaggConfig, clock: Clock) -> None:
        super().__init__(config, clock)
        self.table = RoomTable(clock, config.bootstrap_timeout_s)
        self.bootstrap_queue = 0
        self.inflight_queue = 0

    def _failed(self, session: Session, room: int, reason: str, stage: str) -> TransferFailed:
        return TransferFailed(
            f"Prefill {stage} failed for request rank=0 req.rid={session.rid!r} "
            f"req.bootstrap_room={room} with exception {_kv_error(room, reason)}",
            stage=stage,
        )

    async def bootstrap(self, session: Session) -> Room | None:
        """Wait in the bootstrap queue until D sent its destination for the room; None when
        there is nothing to wait for (fake transfer) or the request was aborted meanwhile."""
        if not self.uses_transfer(session):
            return None
        room_id = session.req.bootstrap_room
        assert room_id is not None
        room = self.table.get(room_id)
        if room.concluded or (room.rid is not None and room.rid != session.rid):
            reason = room.failure_reason or "Duplicate prefill bootstrap room"
            raise self._failed(session, room_id, reason, "bootstrap")
        room.rid = session.rid
        started = self.clock.monotonic()
        self.bootstrap_queue += 1
        try:
            while room.status == KVPoll.Bootstrapping:
                elapsed = self.clock.monotonic() - started
                remaining = self.config.bootstrap_timeout_s - elapsed
                if remaining <= 0:
                    reason = (
                        f"Request {room_id} timed out after {elapsed:.1f}s in KVPoll.Bootstrapping"
                    )
                    self.table.conclude(room, KVPoll.Failed, reason)
                    failure = self._failed(session, room_id, reason, "bootstrap")
                    failure.outcome = "bootstrap_timeout"
                    raise failure
                aborted, _ = await _unless_aborted(session.active, room.changed(remaining))
                if aborted:
                    self.table.conclude(room, KVPoll.Failed, ABORTED)
                    return None
        finally:
            self.bootstrap_queue -= 1
        if room.status == KVPoll.Failed:
            reason = room.failure_reason or ABORTED
            raise self._failed(session, room_id, reason, "bootstrap")
        session.room_use.peer = room.decode
        return room

    def prefilling(self, active: bool) -> None:
        self.inflight_queue += 1 if active else -1

    def transfer(self, session: Session, room: Room | None) -> None:
        """The prefill ran: the KV goes to D (instantly) and the room turns ``Success``."""
        use = session.room_use
        if room is None:
            if not session.active.aborted:
                use.transferred = self.clock.time()
            return
        if session.active.aborted:
            self.table.conclude(room, KVPoll.Failed, ABORTED)
            return
        if room.status == KVPoll.Failed:
            reason = room.failure_reason or ABORTED
            raise self._failed(session, room.room, reason, "transfer")
        room.set(KVPoll.Transferring)
        room.transferred = use.transferred = self.clock.time()
        self.table.conclude(room, KVPoll.Success)

    def abandon(self, session: Session, room: Room | None) -> None:
        """The request ended before its transfer (aborted, refused): D must not wait on."""
        if room is not None and not room.concluded:
            self.table.conclude(room, KVPoll.Failed, ABORTED)

    def _done_outcome(self, use: RoomUse) -> str:
        return "transferred" if use.transferred is not None else "failed"

    def loads(self) -> dict[str, Any]:
        return {
            "mode": "prefill",
            "prefill_bootstrap_queue_reqs": self.bootstrap_queue,
            "prefill_inflight_queue_reqs": self.inflight_queue,
            "decode_prealloc_queue_reqs": 0,
            "decode_transfer_queue_reqs": 0,
            "decode_retracted_queue_reqs": 0,
            "kv_transfer_speed_gb_s": 0.0,
            "kv_transfer_latency_ms": 0.0,
        }

    def pending(self) -> list[dict[str, Any]]:
        return self.table.pending()


class DecodeSide(_Side):
    """D: the handshake with P's bootstrap server and the wait for the room's transfer."""

    peer_key = "prefill"

    def __init__(self, config: DisaggConfig, clock: Clock, own_address: str) -> None:
        super().__init__(config, clock)
        self.own_address = own_address
        self._client: httpx.AsyncClient | None = None
        self._known: set[str] = set()  # bootstrap addresses whose parallel info is fetched
        self._waiting: dict[int, dict[str, Any]] = {}
        self.prealloc_queue = 0
        self.transfer_queue = 0

    @property
    def client(self) -> httpx.AsyncClient:
        if self._client is None:
            timeout = httpx.Timeout(POLL_WAIT_S + 5.0, connect=2.0)
            self._client = httpx.AsyncClient(timeout=timeout, trust_env=False)
        return self._client

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    def _failed(self, session: Session, reason: str, stage: str) -> TransferFailed:
        room = session.req.bootstrap_room
        return TransferFailed(
            f"Decode {stage} failed for request rank=0 decode_req.req.rid={session.rid!r} "
            f"decode_req.req.bootstrap_room={room} with exception {_kv_error(room or 0, reason)}",
            stage="bootstrap" if stage == "handshake" else stage,
        )

    async def receive(self, session: Session) -> bool:
        """Handshake, destination, wait for ``Success``; False if the request was aborted.
        Raises ``TransferFailed`` as SGLang's decode scheduler aborts the request."""
        use = session.room_use
        if not self.uses_transfer(session):
            use.transferred = self.clock.time()
            return True
        req = session.req
        room = req.bootstrap_room
        assert room is not None
        addr = f"{req.bootstrap_host}:{req.bootstrap_port or DEFAULT_BOOTSTRAP_PORT}"
        use.peer = addr
        view = {"room": room, "rid": session.rid, "prefill": addr, "status": "Bootstrapping"}
        self._waiting[id(session)] = view
        try:
            self.prealloc_queue += 1
            try:
                known = await self._handshake(session, addr)
            finally:
                self.prealloc_queue -= 1
            if session.active.aborted:
                return False
            if not known:
                raise self._failed(session, ABORTED, "handshake")
            view["status"] = "WaitingForInput"
            self.transfer_queue += 1
            try:
                return await self._wait_transfer(session, addr, room)
            finally:
                self.transfer_queue -= 1
        finally:
            del self._waiting[id(session)]

    async def _handshake(self, session: Session, addr: str) -> bool:
        """``try_ensure_parallel_info`` then the rank's bootstrap info, once per address."""
        if addr in self._known:
            return True
        for attempt in range(ENSURE_RETRIES):
            if attempt:
                aborted, _ = await _unless_aborted(
                    session.active, asyncio.sleep(ENSURE_RETRY_INTERVAL_S)
                )
                if aborted:
                    return False
            aborted, ok = await _unless_aborted(session.active, self._fetch_info(addr))
            if aborted:
                return False
            if ok:
                self._known.add(addr)
                return True
        return False

    async def _fetch_info(self, addr: str) -> bool:
        ranks = ("prefill_dp_rank", "prefill_cp_rank", "target_tp_rank", "target_pp_rank")
        try:
            for value in (-1, 0):
                params = dict.fromkeys(ranks, value)
                response = await self.client.get(f"http://{addr}/route", params=params)
                if response.status_code != 200:
                    return False
        except httpx.HTTPError:
            return False
        return True

    async def _wait_transfer(self, session: Session, addr: str, room: int) -> bool:
        url = f"http://{addr}/kv/{room}"
        started = self.clock.monotonic()
        sent = False
        failures = 0
        while True:
            elapsed = self.clock.monotonic() - started
            remaining = self.config.waiting_timeout_s - elapsed
            if remaining <= 0:
                reason = f"Request {room} timed out after {elapsed:.1f}s in KVPoll.WaitingForInput"
                await self._notify_abort(addr, room, session.rid)
                failure = self._failed(session, reason, "transfer")
                failure.outcome = "timeout"
                raise failure
            if sent:
                wait = min(remaining, POLL_WAIT_S)
                work = self.client.get(url, params={"wait": f"{wait:.3f}", "rid": session.rid})
            else:
                body = {"decode": self.own_address, "rid": session.rid}
                work = self.client.post(url, json=body)
            try:
                aborted, response = await _unless_aborted(session.active, work)
            except httpx.HTTPError:
                failures += 1
                if failures >= self.config.heartbeat_max_failure:
                    reason = f"Lost connection with prefill instance (bootstrap_addr: {addr})"
                    self._known.discard(addr)
                    raise self._failed(session, reason, "transfer") from None
                aborted, _ = await _unless_aborted(
                    session.active, asyncio.sleep(self.config.heartbeat_interval_s)
                )
                response = None
            if aborted:
                await self._notify_abort(addr, room, session.rid)
                return False
            if response is None:
                continue
            failures = 0
            sent = True
            state = _status(response)
            if state["status"] == "Success":
                session.room_use.transferred = self.clock.time()
                self.last_transfer_ms = (self.clock.monotonic() - started) * 1000
                return True
            if state["status"] == "Failed":
                reason = str(state.get("failure_reason") or ABORTED)
                raise self._failed(session, reason, "transfer")

    async def _notify_abort(self, addr: str, room: int, rid: str) -> None:
        """Tell P to drop the room (SGLang's ``_send_abort_notification``); best effort."""
        with contextlib.suppress(httpx.HTTPError):
            await self.client.post(f"http://{addr}/kv/{room}/abort", json={"rid": rid})

    def _done_outcome(self, use: RoomUse) -> str:
        return "served" if use.transferred is not None else "failed"

    def loads(self) -> dict[str, Any]:
        return {
            "mode": "decode",
            "prefill_bootstrap_queue_reqs": 0,
            "prefill_inflight_queue_reqs": 0,
            "decode_prealloc_queue_reqs": self.prealloc_queue,
            "decode_transfer_queue_reqs": self.transfer_queue,
            "decode_retracted_queue_reqs": 0,
            "kv_transfer_speed_gb_s": 0.0,
            "kv_transfer_latency_ms": self.last_transfer_ms,
        }

    def pending(self) -> list[dict[str, Any]]:
        return [dict(view) for view in self._waiting.values()]


def _status(response: httpx.Response) -> dict[str, Any]:
    """P's answer about a room; anything else than its JSON is a failed transfer."""
    if response.status_code == 200:
        try:
            body = response.json()
        except ValueError:
            body = None
        if isinstance(body, dict) and isinstance(body.get("status"), str):
            return body
    reason = f"Bootstrap server answered {response.status_code}: {response.text[:200]}"
    return {"status": "Failed", "failure_reason": reason}


Side = PrefillSide | DecodeSide


def make_side(config: DisaggConfig, clock: Clock, own_address: str) -> Side | None:
    if config.mode == "prefill":
        return PrefillSide(config, clock)
    if config.mode == "decode":
        return DecodeSide(config, clock, own_address)
    return None
