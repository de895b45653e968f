"""Injected faults and the stream gate (``POST /emulator/faults``, ``POST /emulator/gate``).

Faults (each also a CLI flag of the same name):

- ``fail_status`` + ``fail_ratio``: that share of generation requests is answered at once with
  HTTP ``fail_status`` and an SGLang error body.
- ``die_after_chunks``: after sending that many SSE events the connection is dropped without
  ``[DONE]`` (``die_mode: "process"`` ends the whole process instead, like a crash).
- ``hang_before_first_byte``: generation requests send nothing until the fault is cleared or the
  client goes away.
- ``first_byte_delay_s``: wait this long before the response starts.
- ``inband_error_after_chunks``: after that many SSE events, an in-band
  ``data: {"error": {... "code": 503}}`` then ``data: [DONE]`` (SGLang's abort with a status).
- ``unhealthy``: ``/health`` and ``/health_generate`` answer 503.
- ``accept_collapse``: acceptance collapses to this mean tokens per verify step (1..8; ``true``
  means 1.3), whatever the profile and temperature: the drafter no longer matches the target
  (a bad rollout). Requests admitted while it is set take fewer tokens per step, so their
  ``meta_info.spec_accept_length``, their stream chunks (one per step) and the worker's
  ``/v1/loads`` ``speculative.accept_length`` all fall with it; ``null`` restores the profiles.
  (``--replay`` streams pre-rendered chunks and ignores it.)

The gate: ``{"hold_after_chunks": k}`` makes every stream pause after its k-th SSE event until
``{"release": true}``; ``GET /emulator/gate`` tells how many streams are held right now.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import asdict, dataclass, fields
from typing import Any, Literal

from app.emulator.profiles import BLOCK_SIZE

# Tokens per verify step of a drafter that no longer matches its target: almost every draft is
# rejected, so a step yields the bonus token and now and then one accepted draft.
COLLAPSED_ACCEPT_LENGTH = 1.3


class FaultError(ValueError):
    pass


@dataclass
class Faults:
    fail_status: int | None = None
    fail_ratio: float = 1.0
    die_after_chunks: int | None = None
    die_mode: Literal["connection", "process"] = "connection"
    hang_before_first_byte: bool = False
    first_byte_delay_s: float = 0.0
    inband_error_after_chunks: int | None = None
    unhealthy: bool = False
    accept_collapse: float | None = None

    def update(self, changes: dict[str, Any]) -> None:
        """Apply a partial update; ``{"clear": true}`` resets everything first."""
        known = {f.name for f in fields(self)}
        unknown = set(changes) - known - {"clear"}
        if unknown:
            raise FaultError(f"unknown fault fields: {sorted(unknown)}")
        candidate = Faults() if changes.get("clear") else Faults(**asdict(self))
        for name, value in changes.items():
            if name == "accept_collapse" and value is True:
                value = COLLAPSED_ACCEPT_LENGTH
            if name != "clear":
                setattr(candidate, name, value)
        candidate.validate()
        for name in known:
            setattr(self, name, getattr(candidate, name))

    def validate(self) -> None:
        if self.fail_status is not None and not (
            isinstance(self.fail_status, int) and 400 <= self.fail_status <= 599
        ):
            raise FaultError("fail_status must be an HTTP status 400..599 or null")
        if not isinstance(self.fail_ratio, int | float) or not 0 <= self.fail_ratio <= 1:
            raise FaultError("fail_ratio must be within 0..1")
        for name in ("die_after_chunks", "inband_error_after_chunks"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 0):
                raise FaultError(f"{name} must be a non-negative integer or null")
        if self.die_mode not in ("connection", "process"):
            raise FaultError('die_mode must be "connection" or "process"')
        if not isinstance(self.first_byte_delay_s, int | float) or self.first_byte_delay_s < 0:
            raise FaultError("first_byte_delay_s must be >= 0")
        collapse = self.accept_collapse
        if collapse is not None and (
            isinstance(collapse, bool)
            or not isinstance(collapse, int | float)
            or not 1.0 <= collapse <= BLOCK_SIZE
        ):
            raise FaultError(f"accept_collapse must be within 1..{BLOCK_SIZE}, true or null")
        for name in ("hang_before_first_byte", "unhealthy"):
            if not isinstance(getattr(self, name), bool):
                raise FaultError(f"{name} must be a boolean")

    def should_fail(self, rng: random.Random) -> bool:
        return self.fail_status is not None and rng.random() < self.fail_ratio

    def snapshot(self) -> dict[str, Any]:
        return asdict(self)


class Gate:
    """Holds streams after their k-th SSE event until released."""

    def __init__(self) -> None:
        self.hold_after: int | None = None
        self.held = 0
        self._open = asyncio.Event()
        self._open.set()

    def hold(self, after_chunks: int) -> None:
        if not isinstance(after_chunks, int) or after_chunks < 0:
            raise FaultError("hold_after_chunks must be a non-negative integer")
        self.hold_after = after_chunks
        if self._open.is_set():  # already closed: streams held now stay on the same event
            self._open = asyncio.Event()

    def release(self) -> None:
        self.hold_after = None
        self._open.set()

    def applies(self, sent: int) -> bool:
        return self.hold_after is not None and sent == self.hold_after

    async def wait(self) -> None:
        event = self._open
        self.held += 1
        try:
            await event.wait()
        finally:
            self.held -= 1

    def snapshot(self) -> dict[str, Any]:
        return {"hold_after_chunks": self.hold_after, "held": self.held}
