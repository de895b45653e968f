"""The benchmark plots on docs/benchmarks.md: each is the committed output of its command's
``--docs`` (``loadtest/figures.py``), shown with the table of the same run and the day it ran.

The table is rendered again from the run's committed results (``docs/img/<name>.json``) and must
stand in the page as it is, in the same section as the plot, with "Measured <day of the run>":
a plot regenerated without its table (or the other way round) fails here. A bench that publishes
a plot adds its entry to ``FIGURES``.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest

from loadtest import figures, report, routing
from tests.docs.commands import ROOT

PAGE = ROOT / "docs" / "benchmarks.md"
FIGURES: dict[str, Callable[[dict[str, Any]], str]] = {
    "seed": lambda data: report.markdown_table(
        data["datasets"], data["meta"].get("embedded_speed")
    ),
    "routing": lambda data: routing.markdown_table(data["runs"]),
}


def section_with(text: str, needle: str) -> str:
    """The ``## `` section of the page that holds ``needle``."""
    sections = re.split(r"(?m)^(?=## )", text)
    found = [s for s in sections if needle in s]
    assert found, f"{needle} is not on {PAGE.name}"
    return found[0]


@pytest.mark.parametrize("name", sorted(FIGURES))
def test_plot_is_small_and_self_contained(name: str) -> None:
    svg = figures.DOCS_IMG / f"{name}.svg"
    data = svg.read_bytes()
    assert data.lstrip().startswith((b"<?xml", b"<svg")), f"{svg} is not an SVG"
    assert len(data) < figures.MAX_BYTES, f"{svg}: {len(data)} bytes"
    assert not re.search(rb"""(href|src)=["'](https?:)?//""", data), f"{svg} loads from elsewhere"


@pytest.mark.parametrize("name", sorted(FIGURES))
def test_plot_stands_beside_its_table_command_and_date(name: str) -> None:
    data = figures.published(name)
    section = section_with(PAGE.read_text(encoding="utf-8"), f"](img/{name}.svg)")
    assert FIGURES[name](data) in section, (
        f"the {name} table beside the plot is not the run's: paste what "
        f"`--docs` printed (or render it from docs/img/{name}.json)"
    )
    assert f"Measured {figures.run_date(data['meta'])}" in section
    assert "--docs" in section, "the command that published the plot"


def test_every_published_plot_is_on_the_page() -> None:
    text = PAGE.read_text(encoding="utf-8")
    published = sorted(p.stem for p in figures.DOCS_IMG.glob("*.json"))
    assert published == sorted(FIGURES)
    assert [n for n in published if f"](img/{n}.svg)" not in text] == []
