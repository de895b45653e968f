"""What every section of the settings is built from, wherever its package keeps it: a frozen
model that refuses unknown keys, and the comma-separated lists the environment writes."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, BeforeValidator, ConfigDict


class Section(BaseModel):
    """A section of ``app.config.Settings`` (``health``, ``limits``, ...): frozen, no unknown
    keys."""

    model_config = ConfigDict(extra="forbid", frozen=True)


def split_csv(value: Any) -> Any:
    """A list given as one string (``a,b,c`` from the environment) split on its commas, blanks
    dropped; any other value as it is (a list from the ``--config`` file or the CLI)."""
    if isinstance(value, str):
        return [item.strip() for item in value.split(",") if item.strip()]
    return value


# A list setting's mark, beside pydantic-settings' NoDecode (which keeps the environment's string
# whole for it): ``Annotated[list[str], NoDecode, CSV]``.
CSV = BeforeValidator(split_csv)
