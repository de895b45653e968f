"""docs/configuration.md is the settings model rendered (``make docs-config``): it must match the
model, name every setting, and its environment variables must be the ones the gateway reads."""

from __future__ import annotations

import re
from typing import Any

import pytest
from pydantic import BaseModel, Field, ValidationError
from pydantic_settings import BaseSettings, SettingsConfigDict

from app import config_doc
from app.config import Settings

ROWS = re.compile(r"^\| `([a-z_.]+)`<br>`(DFLASH_GATEWAY_[A-Z_]+)`", re.M)


def documented() -> dict[str, str]:
    """Setting path -> environment variable, as the committed page lists them."""
    return dict(ROWS.findall(config_doc.PAGE.read_text(encoding="utf-8")))


def leaves(model: type[BaseModel], prefix: str = "") -> dict[str, Any]:
    """Every setting's path -> its FieldInfo, sections walked."""
    found: dict[str, Any] = {}
    for name, field in model.model_fields.items():
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            found |= leaves(annotation, f"{prefix}{name}.")
        else:
            found[prefix + name] = field
    return found


def test_committed_page_is_what_the_model_renders() -> None:
    assert config_doc.PAGE.read_text(encoding="utf-8") == config_doc.render(), (
        "docs/configuration.md is out of date: run `make docs-config`"
    )


def test_every_setting_is_on_the_page() -> None:
    assert sorted(documented()) == sorted(leaves(Settings))


def _value_at(settings: Settings, path: str) -> Any:
    value: Any = settings
    for part in path.split("."):
        value = getattr(value, part)
    return value


def _candidates(default: Any) -> list[Any]:
    if isinstance(default, bool):
        return [not default]
    if isinstance(default, int):
        return [default + 1, default - 1]
    if isinstance(default, float):
        return [default * 1.1, default * 0.9, default * 1.5, default / 2, default + 1]
    return []


NUMBERS_AND_SWITCHES = [p for p in sorted(documented()) if _candidates(_value_at(Settings(), p))]


@pytest.mark.parametrize("path", NUMBERS_AND_SWITCHES)
def test_documented_variable_sets_the_setting(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each number and switch: its documented variable, set to another valid value, is read."""
    env = documented()[path]
    candidates = _candidates(_value_at(Settings(), path))
    for value in candidates:
        monkeypatch.setenv(env, str(value).lower() if isinstance(value, bool) else str(value))
        try:
            settings = Settings()
        except ValidationError:
            continue  # outside the setting's bounds: try the next value
        assert _value_at(settings, path) == value, f"{env} did not set {path}"
        return
    pytest.fail(f"no candidate value of {path} was accepted: {candidates}")


class _Section(BaseModel):
    """A section's docstring."""

    # Described by the comment above it,
    # over two lines.
    commented: int = 1
    trailing: float = 2.0  # described at the end of its line
    described: str = Field("x", description="Described by Field(description=...).")


class _Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="DFLASH_GATEWAY_", env_nested_delimiter="__")

    # A top-level setting.
    top: bool = False
    section: _Section = _Section()


class _Undocumented(BaseSettings):
    # Documented.
    fine: int = 1

    bare: int = 2


def test_descriptions_come_from_comments_docstrings_and_fields() -> None:
    page = config_doc.render(_Settings)
    assert (
        "| `top`<br>`DFLASH_GATEWAY_TOP` | A top-level setting.<br>*boolean*; default: `false` |"
    ) in page
    assert "## `section`\n\nA section's docstring." in page
    assert (
        "| `section.commented`<br>`DFLASH_GATEWAY_SECTION__COMMENTED` | "
        "Described by the comment above it, over two lines.<br>*integer*; default: `1` |"
    ) in page
    assert "| Described at the end of its line<br>*number*; default: `2.0` |" in page
    assert "| Described by Field(description=...).<br>*string*; default: `x` |" in page


def test_a_setting_without_description_is_refused() -> None:
    with pytest.raises(config_doc.Undocumented, match=r": bare$"):
        config_doc.render(_Undocumented)


def test_check_mode_reports_a_stale_page(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    stale = tmp_path / "configuration.md"
    stale.write_text(config_doc.render().replace("`8000`", "`8001`"), encoding="utf-8")
    assert config_doc.main(["--check", "--out", str(stale)]) == 1
    assert "make docs-config" in capsys.readouterr().err
    assert config_doc.main(["--out", str(stale)]) == 0
    assert config_doc.main(["--check", "--out", str(stale)]) == 0
