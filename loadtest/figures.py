"""Benchmark plots and their figures, published into the documentation (``--docs``).

A bench run with ``--docs`` writes its plot as ``docs/img/<name>.svg`` (text kept as text: a few
tens of KB) and its results as ``docs/img/<name>.json``, and prints the Markdown table that
``docs/benchmarks.md`` shows beside the plot. ``tests/docs/test_figures.py`` renders the table
from the committed JSON again and checks that the page holds it, with the run's date: the plot,
the table and the date on the page always come from one run.

A new bench with a plot (a routing bench's, for one) publishes the same way: a ``--docs`` flag
calling ``save`` and ``publish_json`` with its own name, its table function in
``tests/docs/test_figures.py``'s ``FIGURES``, and a section in ``docs/benchmarks.md`` holding the
plot, the table and the command.
"""

from __future__ import annotations

import datetime
import json
from pathlib import Path
from typing import Any

DOCS_IMG = Path(__file__).resolve().parents[1] / "docs" / "img"
MAX_BYTES = 200_000  # a plot on the page stays small


def pyplot() -> Any:
    """matplotlib's pyplot, off-screen and set to write small, reproducible SVG; raises
    ImportError without matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams["svg.fonttype"] = "none"  # text as text, not paths: smaller and searchable
    plt.rcParams["svg.hashsalt"] = "dflash-gateway"  # the same figures give the same file
    return plt


def save(fig: Any, path: Path) -> None:
    """Write ``fig`` to ``path`` (PNG or SVG, by the suffix) without a creation date."""
    path.parent.mkdir(parents=True, exist_ok=True)
    metadata = {"Date": None} if path.suffix == ".svg" else {}
    fig.savefig(path, dpi=100, metadata=metadata)


def run_date(meta: dict[str, Any]) -> str:
    """The UTC day a run started (``meta["started_unix"]``), as the page prints it."""
    started = datetime.datetime.fromtimestamp(float(meta["started_unix"]), datetime.UTC)
    return started.strftime("%Y-%m-%d")


def publish_json(name: str, data: dict[str, Any]) -> Path:
    path = DOCS_IMG / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    return path


def published(name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((DOCS_IMG / f"{name}.json").read_text(encoding="utf-8"))
    return data
