"""``routing.*`` settings (a section of ``app.config.Settings``): acceptance-collapse detection.

A worker is *collapsed* when the EWMA of its per-request acceptance length (completion tokens
per verify step, exact or estimated, one sample per answered request) falls below
``collapse_ratio`` times the median of its peers' EWMAs; it is clear again once it is back at
``collapse_clear_ratio`` times the median (hysteresis). Only workers with at least
``collapse_min_samples`` requests count, as the judged worker and as peers.
"""

from __future__ import annotations

from pydantic import Field, model_validator

from app.sections import Section


class RoutingConfig(Section):
    """Acceptance-collapse detection: a worker whose acceptance length fell far below its peers'."""

    # A worker is collapsed when its acceptance-length EWMA is below this x its peers' median.
    collapse_ratio: float = Field(0.6, gt=0, lt=1)
    # A collapsed worker is clear again at this x its peers' median (not below collapse_ratio).
    collapse_clear_ratio: float = Field(0.7, gt=0, le=1)
    # Answered requests a worker needs before it is judged, or counts as a peer.
    collapse_min_samples: int = Field(20, ge=1)
    # Weight of each new request in the EWMA (0.1: about the last 20 requests matter).
    collapse_ewma_alpha: float = Field(0.1, gt=0, le=1)
    # Route to a collapsed worker only while no other candidate has admission room. Off by
    # default: acceptance also differs by workload, so it is reported (and alerted on) first.
    deweight_collapsed: bool = False

    @model_validator(mode="after")
    def _hysteresis(self) -> RoutingConfig:
        if self.collapse_clear_ratio < self.collapse_ratio:
            raise ValueError("collapse_clear_ratio must be >= collapse_ratio")
        return self
