from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.support.procs import PYTHON, ProcessManager

ROOT = Path(__file__).resolve().parents[1]


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "app", *args], capture_output=True, text=True, timeout=60
    )


@pytest.mark.processes
def test_help_lists_every_subcommand() -> None:
    result = _run("--help")
    assert result.returncode == 0
    for command in ("serve", "emulate"):
        assert command in result.stdout
    # `bench` is registered by the installed metadata (pyproject's dflash_gateway.commands).
    assert "bench" in result.stdout, "no `bench`: installed before pyproject.toml (make install)"


@pytest.mark.processes
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


@pytest.mark.processes
def test_bad_settings_exit_2_with_a_clear_message() -> None:
    result = _run("serve", "--worker-url", "ftp://nope")
    assert result.returncode == 2
    assert "must start with http" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.processes
def test_console_script_is_installed() -> None:
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


def _install_command_package(site: Path, entry_points: str, module: str = "") -> None:
    """A distribution on ``site`` (added to PYTHONPATH) registering ``dflash_gateway.commands``."""
    info = site / "hello_commands-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: hello-commands\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[dflash_gateway.commands]\n{entry_points}\n")
    if module:
        (site / "hello_commands.py").write_text(module)


def _run_with(site: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(site)}
    return subprocess.run(
        [sys.executable, "-m", "app", *args], capture_output=True, text=True, timeout=60, env=env
    )


@pytest.mark.processes
def test_installed_packages_add_subcommands_through_entry_points(tmp_path: Path) -> None:
    _install_command_package(
        tmp_path,
        "hello = hello_commands",
        "def add_parser(subparsers):\n"
        "    subparsers.add_parser('hello', help='say hello').add_argument('--name')\n"
        "def run(args):\n"
        "    print(f'hello {args.name}')\n"
        "    return 3\n",
    )
    assert "say hello" in _run_with(tmp_path, "--help").stdout
    done = _run_with(tmp_path, "hello", "--name", "world")
    assert (done.returncode, done.stdout) == (3, "hello world\n"), done.stderr


@pytest.mark.processes
def test_a_subcommand_whose_package_is_missing_does_not_exist(tmp_path: Path) -> None:
    """The container image ships the gateway without the benchmarks: ``bench`` is absent there,
    and the other commands work."""
    _install_command_package(tmp_path, "ghost = no_such_package_for_dflash.cli")
    shown = _run_with(tmp_path, "--help")
    assert shown.returncode == 0, shown.stderr
    assert "ghost" not in shown.stdout
    assert "emulate" in shown.stdout
    done = _run_with(tmp_path, "ghost")
    assert done.returncode == 2
    assert "invalid choice: 'ghost'" in done.stderr
    assert "Traceback" not in done.stderr


def test_the_gateway_never_imports_the_benchmarks() -> None:
    """Dependencies run one way: loadtest imports app, app never imports loadtest."""
    offenders = []
    for path in sorted((ROOT / "app").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            if any(n == "loadtest" or n.startswith("loadtest.") for n in names):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not offenders, f"app imports loadtest at {offenders}"


def test_serve_takes_sglang_routers_pd_flags() -> None:
    from app.__main__ import _pd_flags, serve_parser
    from app.config import load_settings

    args = serve_parser().parse_args(
        [
            "--pd-disaggregation",
            "--prefill", "http://p0:30000", "9001",
            "--prefill", "http://p1:30000",
            "--decode", "http://d0:30000",
            "--decode", "http://d1:30000",
            "--prefill-policy", "prefix_affinity",
        ]
    )  # fmt: skip
    settings = load_settings(pd=_pd_flags(args))
    assert settings.pd.disaggregation
    assert settings.pd.prefill_workers() == [("http://p0:30000", 9001), ("http://p1:30000", 8998)]
    assert settings.pd.decode == ["http://d0:30000", "http://d1:30000"]
    assert settings.pd.prefill_policy == "prefix_affinity"
    assert _pd_flags(serve_parser().parse_args([])) is None  # no flag: env and file decide


@pytest.mark.processes
def test_bad_pd_flags_exit_2_with_a_clear_message() -> None:
    result = _run("serve", "--pd-disaggregation", "--prefill", "http://p:1", "1", "2")
    assert result.returncode == 2
    assert "--prefill takes URL [BOOTSTRAP_PORT]" in result.stderr
    result = _run("serve", "--pd-disaggregation", "--prefill", "http://p:1")
    assert result.returncode == 2
    assert "at least one prefill and one decode worker" in result.stderr
    assert "Traceback" not in result.stderr
