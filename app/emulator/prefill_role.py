"""The prefill role (``--disaggregation-mode prefill``): the room table its bootstrap server
serves (``app.emulator.bootstrap``), each request's wait for the decode side's destination, and the
transfer after its prefill. SGLang 0.5.23: ``disaggregation/prefill.py``; see
``app.emulator.disagg``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from app.emulator.disagg import (
    ABORTED,
    DisaggConfig,
    RoleSide,
    RoomUse,
    TransferFailed,
    kv_error,
    unless_aborted,
)
from app.emulator.engine import Clock
from app.emulator.rooms import KVPoll, Room, RoomTable

if TYPE_CHECKING:
    from app.emulator.session import Session


class PrefillSide(RoleSide):
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
            f"req.bootstrap_room={room} with exception {kv_error(room, reason)}",
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
                aborted, _ = await unless_aborted(session.active, room.changed(remaining))
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
