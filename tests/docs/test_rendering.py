"""The built site as a reader sees it: every page rendered in headless Chromium at a desktop and a
phone width, and checked for what breaks reading (``layout.js``): a table or code block running
past the text column or cut off without a scroll bar, a block a reader copies (shell, Python,
YAML, TOML) that must be scrolled sideways to be read whole (desktop), a name in a table broken
mid-word, a broken image, a page wider than the window.

Chromium is Debian's ``chromium`` (``.ci/run`` installs it); without it the tests are skipped with
the reason (failed under ``DFLASH_REQUIRE_TOOLS=1``). It is driven over the DevTools protocol on
a pipe (``tests/support/browser.py``): no port, no browser download.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.support.browser import Browser, page_url
from tests.support.tools import missing

pytestmark = pytest.mark.processes

ROOT = Path(__file__).resolve().parents[2]
CHECK = (Path(__file__).parent / "layout.js").read_text(encoding="utf-8")
BROWSERS = ("chromium", "chromium-browser", "google-chrome")
# (name, width, height, whether shell blocks must fit): the theme shows both sidebars from
# 76.25em (1220 px), so 1280 is the narrowest text column a desktop reader gets.
SHOWN = 8  # problems listed per page and width
VIEWPORTS = (("desktop", 1280, 900, True), ("phone", 400, 850, False))


def chromium() -> str:
    for name in BROWSERS:
        found = shutil.which(name)
        if found:
            return found
    missing("chromium", ".ci/run installs it: apt-get install chromium")


def build(config: Path, site: Path, *, strict: bool = True) -> None:
    argv = [sys.executable, "-m", "mkdocs", "build", "--quiet", "-f", str(config), "-d", str(site)]
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    argv += ["--strict"] if strict else []
    # from the root: docs/worker.md includes docker/worker.md
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    program = chromium()
    opened = Browser(program)
    try:
        yield opened
    finally:
        opened.close()


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    build(ROOT / "mkdocs.yml", out)
    return out


def problems(browser: Browser, page: Path, width: int, height: int, fit: bool) -> list[str]:
    browser.set_viewport(width, height)
    browser.load(page_url(page))
    found: list[str] = browser.evaluate(CHECK.replace("COMMANDS_FIT", "true" if fit else "false"))
    return found


@pytest.mark.timeout(600)  # ~40 page loads: 15 s on a quiet machine, minutes on a loaded one
def test_every_page_reads_without_overflow(browser: Browser, site: Path) -> None:
    pages = sorted(p for p in site.rglob("index.html") if "search" not in p.parts)
    assert len(pages) == len(list((ROOT / "docs").rglob("*.md"))), pages
    found = []
    for name, width, height, fit in VIEWPORTS:
        for page in pages:
            rel = page.parent.relative_to(site).as_posix() or "home"
            seen = problems(browser, page, width, height, fit)
            more = [f"... and {len(seen) - SHOWN} more"] if len(seen) > SHOWN else []
            found += [f"{rel} ({name}): {p}" for p in seen[:SHOWN] + more]
    assert found == [], "\n".join(found)


BAD_PAGE = """\
# A page with every fault

<div style="overflow: hidden"><table class="fixed" style="width: 2400px"><tr><td>wide</td></tr>
</table></div>

<pre class="clipped" style="overflow: hidden"><code style="overflow: hidden">{long}</code></pre>

<table><tr><td>a</td><td style="max-width: 5em"><code style="word-break: break-all">
DFLASH_GATEWAY_A_VERY_LONG_SETTING_NAME</code></td><td>{words}</td></tr></table>

![a plot](img/missing.png)

```bash
echo {long}
```
"""


def test_the_check_finds_each_fault(browser: Browser, tmp_path: Path) -> None:
    """The checks can fail: a page made of one instance of each fault is reported for each."""
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))
    docs = tmp_path / "docs"
    shutil.copytree(ROOT / "docs" / "stylesheets", docs / "stylesheets")
    long, words = "x" * 400, " ".join(["word"] * 200)
    (docs / "index.md").write_text(BAD_PAGE.format(long=long, words=words), encoding="utf-8")
    config |= {"docs_dir": str(docs), "nav": ["index.md"], "strict": False}
    config.pop("validation", None)
    (tmp_path / "mkdocs.yml").write_text(yaml.safe_dump(config), encoding="utf-8")
    build(tmp_path / "mkdocs.yml", tmp_path / "site", strict=False)
    found = "\n".join(problems(browser, tmp_path / "site" / "index.html", 1280, 900, True))
    for fault in (
        "a table runs",
        "a code block is cut off without a scroll bar",
        "breaks across lines mid-word",
        "a broken image: img/missing.png",
        "a command or code block scrolls sideways",
    ):
        assert fault in found, found
