"""``bench routing --replot``: the plot drawn again from a finished run's results, nothing run.
The committed results of the run on docs/benchmarks.md serve as the saved run."""

from __future__ import annotations

from pathlib import Path

import pytest

from loadtest import cli, figures, routing


def test_replot_draws_a_saved_run_without_running_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    saved = figures.DOCS_IMG / "routing.json"
    assert cli.main(["routing", "--replot", str(saved), "--out", str(tmp_path)]) == 0
    assert (tmp_path / "routing.png").read_bytes().startswith(b"\x89PNG")
    assert not (tmp_path / "routing.json").exists()  # nothing was run, so no new results
    out = capsys.readouterr().out
    assert "routing.png" in out
    assert routing.markdown_table(figures.published("routing")["runs"]) not in out  # no --docs


def test_the_page_table_is_rendered_from_the_runs() -> None:
    runs = figures.published("routing")["runs"]
    table = routing.markdown_table(runs).splitlines()
    assert len(table) == 2 + len(runs)
    first = runs[0]
    assert table[2].startswith(f"| {first['fleet']} | `{first['policy']}` | ")
    assert " / ".join(map(str, first["requests_per_worker"])) in table[2]
