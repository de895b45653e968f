"""``auth.*`` settings (a section of ``app.config.Settings``): the keys file and what a key
protects."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, field_validator

from app.auth.keystore import read_keys_file
from app.sections import Section


class AuthConfig(Section):
    """Client API keys (``api_keys`` holds keys given directly) and what they protect."""

    # A file of NAME:KEY lines (e.g. a mounted Secret), re-read every reload_s (``--api-key-file``).
    # Every key at least 16 characters; a bad line stops start-up (a reload keeps the last set).
    keys_file: Path | None = None
    # Seconds between two reads of keys_file: a revoked key stops working without a restart.
    reload_s: float = Field(10.0, gt=0)
    # /metrics and /workers (worker URLs, key names) need a key. Unset (the default): they do
    # when API keys are configured, and the separate metrics port (metrics_port, for Prometheus)
    # stays open; true: a key on the metrics port too; false: open to anyone who can reach them.
    # Probes (/livez, /readyz, /health) never need one.
    protect_ops: bool | None = None

    @field_validator("keys_file")
    @classmethod
    def _check_keys_file(cls, path: Path | None) -> Path | None:
        if path is not None:
            read_keys_file(path)  # an unreadable file is only warned about (it may appear later)
        return path
