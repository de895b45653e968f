"""``embedded.*`` settings (a section of ``app.config.Settings``): the emulated workers ``serve``
starts when no worker source is configured."""

from __future__ import annotations

from pydantic import Field

from app.sections import Section

DEFAULT_MODEL = "moonshotai/Kimi-K2.5"


class EmbeddedConfig(Section):
    """The embedded default: emulated workers started as child processes."""

    # How many emulated workers to start.
    workers: int = Field(2, ge=1, le=16)
    # The first worker's port, the next ones following (a free port when taken, or when 0).
    base_port: int = Field(30000, ge=0, le=65535)
    # The emulated workers' ``--speed``: how many times faster than the real fleet they answer.
    speed: float = Field(1.0, gt=0)
    # The model the emulated workers serve.
    model: str = DEFAULT_MODEL
