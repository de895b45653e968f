"""Bootstrap rooms: the prefill side's room table and both roles' per-room records.

A room (SGLang's ``bootstrap_room``, a 63-bit id the router picks per request) names one KV
transfer from one prefill server to one decode server. On the prefill side a room goes through
SGLang's ``KVPoll`` states (``disaggregation/base/conn.py``): ``Bootstrapping`` until the decode
side has sent its destination for the room, ``WaitingForInput`` until the prefill ran,
``Transferring``, then ``Success`` or ``Failed``. Either side may come first: the decode side's
destination can reach the prefill server before the prefill request does (the router sends both
at once), as SGLang's KV manager keeps ``transfer_infos`` for a room it has no sender for yet.

A concluded room stays as a tombstone for the bootstrap timeout, so a late arrival for it fails
at once instead of waiting (``common/bootstrap.py`` ``DeferredBootstrap.close`` keeps one for the
same reason); tombstones and rooms nobody owns expire then.

``RoomBook`` keeps what each role did with each room, for tests and operators: which rooms a
prefill server transferred, which a decode server served, timed out or aborted
(``GET /emulator/stats`` ``rooms``).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
from collections import deque
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any

from app.emulator.engine import Clock


class KVPoll(enum.IntEnum):
    """SGLang's ``KVPoll`` (``disaggregation/base/conn.py``), same values."""

    Failed = 0
    Bootstrapping = 1
    WaitingForInput = 2
    Transferring = 3
    Success = 4


@dataclass(eq=False)
class Room:
    """One room on the prefill side."""

    room: int
    status: KVPoll = KVPoll.Bootstrapping
    rid: str | None = None  # the prefill request that owns it, once it arrived
    decode: str | None = None  # host:port of the decode server that sent its destination
    decode_rid: str | None = None
    failure_reason: str | None = None
    registered: float | None = None  # when the decode side's destination arrived
    transferred: float | None = None
    expires_mono: float = 0.0
    _changed: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def concluded(self) -> bool:
        return self.status in (KVPoll.Success, KVPoll.Failed)

    def set(self, status: KVPoll, reason: str | None = None) -> None:
        if self.concluded:
            return
        self.status = status
        if reason is not None:
            self.failure_reason = reason
        self._changed.set()
        self._changed = asyncio.Event()

    def changed(self, within_s: float) -> Awaitable[None]:
        """Until the room's status changes from what it is now, at most ``within_s`` seconds
        (the change is the one after this call, even if the wait starts later)."""
        event = self._changed

        async def wait() -> None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(event.wait(), within_s)

        return wait()

    def view(self) -> dict[str, Any]:
        return {
            "room": self.room,
            "status": self.status.name,
            "rid": self.rid,
            "decode": self.decode,
            "failure_reason": self.failure_reason,
        }


class RoomTable:
    """The prefill server's rooms (``room -> Room``), with bounded tombstones."""

    def __init__(self, clock: Clock, keep_s: float) -> None:
        self._clock = clock
        self._keep_s = keep_s
        self.rooms: dict[int, Room] = {}
        self._next_cleanup = 0.0

    def get(self, room: int) -> Room:
        """The room, created (``Bootstrapping``) if nobody named it before."""
        now = self._clock.monotonic()
        if now >= self._next_cleanup:
            self.rooms = {
                key: state
                for key, state in self.rooms.items()
                if (state.rid is not None and not state.concluded) or state.expires_mono > now
            }
            self._next_cleanup = now + min(1.0, self._keep_s)
        state = self.rooms.get(room)
        if state is None:
            state = Room(room, expires_mono=now + self._keep_s)
            self.rooms[room] = state
        return state

    def conclude(self, state: Room, status: KVPoll, reason: str | None = None) -> None:
        """``Success`` or ``Failed``; the room stays as a tombstone for ``keep_s``."""
        state.set(status, reason)
        state.expires_mono = self._clock.monotonic() + self._keep_s

    def pending(self) -> list[dict[str, Any]]:
        """Rooms not concluded yet (a request or a destination is waiting on them)."""
        return [state.view() for state in self.rooms.values() if not state.concluded]


class RoomBook:
    """Per-room records of one worker: the last ``keep`` of them, in the order they ended."""

    def __init__(self, mode: str, keep: int = 20_000) -> None:
        self.mode = mode
        self.records: deque[dict[str, Any]] = deque(maxlen=keep)

    def add(self, record: dict[str, Any]) -> None:
        self.records.append(record)

    def reset(self) -> None:
        self.records.clear()
