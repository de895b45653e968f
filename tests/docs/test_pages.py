"""The README stays a front door (short, every link resolving), and the docs name every metric the
gateway exports, so neither can drift from the code unnoticed. (Links inside docs/ are checked by
``mkdocs build --strict``: ``make docs-build``, run by CI.)"""

from __future__ import annotations

import re
from pathlib import Path

from prometheus_client import CollectorRegistry

from app.metrics.families import PREFIX, Families

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
LINK = re.compile(r"\]\(([^)#\s]+)(#[^)\s]*)?\)")


def test_readme_is_a_front_door() -> None:
    assert len(README.read_text(encoding="utf-8").splitlines()) <= 250


def test_readme_links_resolve() -> None:
    links = LINK.findall(README.read_text(encoding="utf-8"))
    local = [target for target, _ in links if "://" not in target]
    assert local, "the README links into docs/"
    missing = [target for target in local if not (ROOT / target).is_file()]
    assert missing == []


def test_docs_pages_are_all_in_the_site_nav() -> None:
    """mkdocs warns (and --strict fails) on an unlisted page only when it builds; this says which
    page is missing without a build."""
    nav = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    pages = sorted(p.relative_to(ROOT / "docs").as_posix() for p in (ROOT / "docs").rglob("*.md"))
    assert [page for page in pages if f": {page}\n" not in nav] == []


def test_every_metric_is_named_in_the_contracts() -> None:
    registry = CollectorRegistry()
    Families(registry)
    names = {
        metric.name.removeprefix(PREFIX) + ("_total" if metric.type == "counter" else "")
        for metric in registry.collect()
    }
    contracts = (ROOT / "docs" / "contracts.md").read_text(encoding="utf-8")
    assert sorted(n for n in names if not re.search(rf"`{re.escape(n)}[`{{]", contracts)) == []
