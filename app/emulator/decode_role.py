"""The decode role (``--disaggregation-mode decode``): the handshake with the prefill server's
bootstrap server and the wait for the room's transfer, before the request's verify steps. SGLang
0.5.23: ``disaggregation/decode.py``, ``common/conn.py`` ``CommonKVReceiver``; see
``app.emulator.disagg``."""

from __future__ import annotations

import asyncio
import contextlib
from typing import TYPE_CHECKING, Any

import httpx

from app.emulator.disagg import (
    ABORTED,
    DEFAULT_BOOTSTRAP_PORT,
    ENSURE_RETRIES,
    ENSURE_RETRY_INTERVAL_S,
    POLL_WAIT_S,
    DisaggConfig,
    RoleSide,
    RoomUse,
    TransferFailed,
    kv_error,
    unless_aborted,
)
from app.emulator.engine import Clock

if TYPE_CHECKING:
    from app.emulator.session import Session


class DecodeSide(RoleSide):
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
            f"decode_req.req.bootstrap_room={room} with exception {kv_error(room or 0, reason)}",
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
                aborted, _ = await unless_aborted(
                    session.active, asyncio.sleep(ENSURE_RETRY_INTERVAL_S)
                )
                if aborted:
                    return False
            aborted, ok = await unless_aborted(session.active, self._fetch_info(addr))
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
                aborted, response = await unless_aborted(session.active, work)
            except httpx.HTTPError:
                failures += 1
                if failures >= self.config.heartbeat_max_failure:
                    reason = f"Lost connection with prefill instance (bootstrap_addr: {addr})"
                    self._known.discard(addr)
                    raise self._failed(session, reason, "transfer") from None
                aborted, _ = await unless_aborted(
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
