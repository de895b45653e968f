"""Command-line clients published on npm (e.g. ``@openai/codex``), installed by the tests that run
them: ``npm install`` of one pinned version into ``.tools/npm/<name>@<version>/`` (no root, no
global install), once; later runs reuse it. The install goes to a temporary directory first and
is renamed into place, so a concurrent or interrupted run never sees half a package.

Without ``npm`` on ``PATH``, or when the install fails (no registry), the test is skipped with a
one-line reason; under ``DFLASH_REQUIRE_TOOLS=1`` (``.ci/run``) that is a failure instead
(``tests.support.tools``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from tests.support.tools import REQUIRE_ENV, TOOLS_DIR, tools_required


def _unavailable(reason: str) -> None:
    if tools_required():
        pytest.fail(f"{reason}; {REQUIRE_ENV}=1 forbids skipping", pytrace=False)
    pytest.skip(reason)


def npm_binary(package: str, version: str, binary: str) -> str:
    """The path of ``binary`` from ``package@version``, installed into ``.tools/npm/`` if it is
    not there yet; skips the test (fails under ``DFLASH_REQUIRE_TOOLS=1``) when it cannot be."""
    home = TOOLS_DIR / "npm" / f"{package.replace('/', '+')}@{version}"
    found = home / "node_modules" / ".bin" / binary
    if found.is_file() and os.access(found, os.X_OK):
        return str(found)
    npm = shutil.which("npm")
    if npm is None:
        _unavailable(f"npm not found: cannot install {package}@{version}")
    home.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=home.parent) as work:
        command = [npm, "install", "--no-save", "--no-audit", "--no-fund", "--prefix", work]
        try:
            subprocess.run(
                [*command, f"{package}@{version}"], capture_output=True, timeout=600, check=True
            )
        except (OSError, subprocess.SubprocessError) as exc:
            _unavailable(f"npm install {package}@{version} failed: {str(exc)[:200]}")
        staged = Path(work)
        if not (staged / "node_modules" / ".bin" / binary).exists():
            _unavailable(f"{package}@{version} has no {binary} binary")
        try:
            staged.rename(home)  # atomic; a concurrent run that won keeps its copy
        except OSError:
            if not found.is_file():
                raise
        else:
            staged.mkdir()  # for TemporaryDirectory's cleanup
    return str(found)
