from __future__ import annotations

import subprocess
import sys

import httpx

from tests.support.procs import PYTHON, ProcessManager


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "app", *args], capture_output=True, text=True, timeout=60
    )


def test_help_lists_every_subcommand() -> None:
    result = _run("--help")
    assert result.returncode == 0
    for command in ("serve", "emulate", "bench"):
        assert command in result.stdout


def test_serve_help_documents_the_contract_flags() -> None:
    result = _run("serve", "--help")
    assert result.returncode == 0
    for flag in (
        "--host",
        "--port",
        "--worker-url",
        "--policy",
        "--processes",
        "--api-key",
        "--config",
    ):
        assert flag in result.stdout


def test_bad_settings_exit_2_with_a_clear_message() -> None:
    result = _run("serve", "--worker-url", "ftp://nope")
    assert result.returncode == 2
    assert "must start with http" in result.stderr
    assert "Traceback" not in result.stderr


def test_console_script_is_installed() -> None:
    from pathlib import Path

    script = Path(sys.executable).with_name("dflash-gateway")
    result = subprocess.run([str(script), "--version"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0
    assert result.stdout.startswith("dflash-gateway ")


def test_serve_answers_livez_and_openai_404(procs: ProcessManager) -> None:
    gw = procs.start(
        [PYTHON, "-m", "app", "serve", "--port", "{port}", "--worker-url", "http://127.0.0.1:9"],
        name="gateway",
        ready_path="/livez",
    )
    assert httpx.get(gw.url + "/livez").status_code == 200
    missing = httpx.get(gw.url + "/v1/nope")
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "not_found"
