"""The role a disaggregated emulator plays (``--disaggregation-mode``), or none."""

from __future__ import annotations

from app.emulator.decode_role import DecodeSide
from app.emulator.disagg import DisaggConfig
from app.emulator.engine import Clock
from app.emulator.prefill_role import PrefillSide

Side = PrefillSide | DecodeSide


def make_side(config: DisaggConfig, clock: Clock, own_address: str) -> Side | None:
    if config.mode == "prefill":
        return PrefillSide(config, clock)
    if config.mode == "decode":
        return DecodeSide(config, clock, own_address)
    return None
