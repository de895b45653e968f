"""External programs: a missing one skips its test with the reason in pytest's summary (fails
under DFLASH_REQUIRE_TOOLS=1, as in CI); redis-server is fetched when it is not installed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.tools import REQUIRE_ENV, ROOT

pytestmark = pytest.mark.processes

USES_A_MISSING_TOOL = """
from tests.support.tools import require_tool

def test_needs_it():
    require_tool("dflash-no-such-tool")
"""


USES_AN_NPM_TOOL = """
from tests.support.tools import npm_tool

def test_needs_it():
    npm_tool("@anthropic-ai/claude-code", "2.1.332", "claude")
"""


def _pytest(
    tmp_path: Path, test: str = USES_A_MISSING_TOOL, **env: str
) -> subprocess.CompletedProcess[str]:
    (tmp_path / "test_uses_tool.py").write_text(test)
    environ = {k: v for k, v in os.environ.items() if k != REQUIRE_ENV}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rs", str(tmp_path)],
        cwd=tmp_path,
        env={**environ, "PYTHONPATH": str(ROOT), **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_missing_tool_skips_with_a_reason_in_the_summary(tmp_path: Path) -> None:
    done = _pytest(tmp_path)
    assert done.returncode == 0, done.stdout
    assert "1 skipped" in done.stdout
    assert "dflash-no-such-tool not found (.ci/run installs it" in done.stdout


def test_ci_fails_instead_of_skipping(tmp_path: Path) -> None:
    done = _pytest(tmp_path, **{REQUIRE_ENV: "1"})
    assert done.returncode == 1, done.stdout
    assert "1 failed" in done.stdout
    assert f"{REQUIRE_ENV}=1 forbids skipping" in done.stdout


def test_redis_server_is_fetched_into_the_tools_dir_when_not_installed(tmp_path: Path) -> None:
    empty = tmp_path / "bin"
    empty.mkdir()
    tools = tmp_path / "tools"
    find = "from tests.support.tools import find_tool; print(find_tool('redis-server'))"
    env = {
        **os.environ,
        "PATH": str(empty),
        "DFLASH_TOOLS_DIR": str(tools),
        "PYTHONPATH": str(ROOT),
    }
    done = subprocess.run(
        [sys.executable, "-c", find], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.stdout.strip() == str(tools / "redis" / "redis-server"), done.stderr
    version = subprocess.run(
        [tools / "redis" / "redis-server", "--version"], capture_output=True, text=True, timeout=30
    )
    assert version.stdout.startswith("Redis server v=")


def test_an_npm_tool_without_npm_skips_with_a_reason(tmp_path: Path) -> None:
    empty = tmp_path / "bin"
    empty.mkdir()
    tools = str(tmp_path / "tools")
    done = _pytest(tmp_path, USES_AN_NPM_TOOL, PATH=str(empty), DFLASH_TOOLS_DIR=tools)
    assert done.returncode == 0, done.stdout
    assert "1 skipped" in done.stdout
    assert "npm not found (.ci/run installs it: apt-get install npm)" in done.stdout
    required = _pytest(
        tmp_path, USES_AN_NPM_TOOL, PATH=str(empty), DFLASH_TOOLS_DIR=tools, **{REQUIRE_ENV: "1"}
    )
    assert required.returncode == 1 and "1 failed" in required.stdout, required.stdout
