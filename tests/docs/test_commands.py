"""Every command a newcomer runs locally (README, Getting started, Coding agents, Benchmarks) runs
as written on a fresh clone, or is marked as needing what a test machine lacks (a cluster, a GPU,
a third-party client) or as too long to run (then it is checked without running it). The marker
convention is in ``tests/docs/commands.py``.

The fresh clone is the repository's files (tracked, plus new ones not ignored) copied into a
temporary directory: no ``.venv``, no ``.tools``, nothing built. The first command on it,
``make run``, installs the project (about a minute); the copy is shared by the pages (a page run
on its own gets ``make install`` first, as its reader followed the README). Commands
run with a ``PATH`` that holds no virtualenv, so a page that calls ``dflash-gateway`` without
``.venv/bin/`` (or an activation line) fails here as it would for a reader. The only change made
to a command: the gateway's documented port 8000 becomes a free one (``DFLASH_GATEWAY_PORT``, and
in the commands' URLs), as other test runs may share this machine.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from tests.docs.commands import MODES, PAGES, ROOT, SHELLS, Block, blocks, command_blocks, commands

INSTALL_S = 900  # make install on a fresh clone, on a loaded 2-core machine
COMMAND_S = 300


def test_every_block_names_its_language() -> None:
    """A block without a language could hide a command from the checks below."""
    unnamed = [b.where for page in PAGES for b in blocks(page) if not b.language]
    assert unnamed == []


def test_markers_are_known_and_give_their_reason() -> None:
    bad = []
    for block in command_blocks():
        if block.mode not in MODES:
            bad.append(f"{block.where}: unknown mode {block.mode!r} (one of {MODES})")
        elif block.mode in ("long", "cluster", "gpu", "client") and not block.reason:
            bad.append(f"{block.where}: `{block.mode}` needs its reason")
        elif block.mode == "client" and block.reason.startswith("tests/"):
            test = block.reason.split()[0]
            if not (ROOT / test).is_file():
                bad.append(f"{block.where}: {test} does not exist")
        elif block.mode == "server" and block.language not in SHELLS:
            bad.append(f"{block.where}: a server block is a shell block")
    assert bad == []


def test_each_page_has_commands_that_run() -> None:
    """The marks are exceptions: each page's first steps run for real."""
    for page in ("README.md", "docs/getting-started.md"):
        modes = {b.mode for b in command_blocks() if b.page == page}
        assert {"server", "run"} <= modes, (page, modes)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@pytest.fixture(scope="module")
def clone(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The repository's files, as a fresh clone has them."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.decode()
    dest = tmp_path_factory.mktemp("clone") / "dflash-gateway"
    for name in filter(None, listed.split("\0")):
        source = ROOT / name
        if source.is_file():  # a file deleted in the work tree is not in the clone either
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            (dest / name).write_bytes(source.read_bytes())
            (dest / name).chmod(source.stat().st_mode)
    return dest


def reader_env(port: int) -> dict[str, str]:
    """A new shell's environment: no virtualenv on PATH, no gateway settings but the port."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("DFLASH_GATEWAY_", "VIRTUAL_ENV", "PYTEST_"))
    }
    path = [p for p in env.get("PATH", "").split(os.pathsep) if "/.venv/" not in p + "/"]
    env["PATH"] = os.pathsep.join(path)
    env["DFLASH_GATEWAY_PORT"] = str(port)
    env["DFLASH_GATEWAY_EMBEDDED__BASE_PORT"] = "0"  # the emulated workers on free ports too
    return env


class Server:
    """A server block, started as a reader starts it in a terminal; stopped with Ctrl-C."""

    def __init__(self, block: Block, text: str, cwd: Path, env: dict[str, str], port: int):
        self.block = block
        self.log = cwd.parent / f"server-{block.line}.log"
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(
                ["bash", "-e", "-c", text],
                cwd=cwd,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.monotonic() + INSTALL_S
        url = f"http://127.0.0.1:{port}/readyz"
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.fail(f"exited with {self.proc.returncode} before it was ready")
            try:
                if httpx.get(url, timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.fail(f"not ready on {url} after {INSTALL_S} s")

    def fail(self, why: str) -> None:
        self.stop()
        output = self.log.read_text(errors="replace")[-4000:]
        pytest.fail(f"{self.block.where}: the server block {why}:\n{output}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)  # Ctrl-C: the whole foreground group
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        # what the gateway started, should anything outlive Ctrl-C
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)


def run(block: Block, argv: list[str], cwd: Path, env: dict[str, str]) -> None:
    done = subprocess.run(
        argv,
        cwd=cwd,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=COMMAND_S,
    )
    assert done.returncode == 0, (
        f"{block.where}: {shlex.join(argv)[-300:]} exited {done.returncode}\n"
        f"{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    )


ASSIGNMENT = re.compile(r"""[A-Za-z_]\w*=("[^"]*"|'[^']*'|\S*)""")


def check_without_running(block: Block, text: str, cwd: Path, env: dict[str, str]) -> None:
    """A long block, checked without running its work: make targets are dry-run (``make -n``),
    other commands asked for ``--help`` (their options up to it parsed), variables set as
    written; one shell, so later lines see the variables."""
    script = []
    for command in commands(text):
        command = command.split(" #", 1)[0].rstrip()
        if ASSIGNMENT.fullmatch(command):
            script.append(command)
        elif command.startswith("make "):
            script.append("make -n " + command.removeprefix("make "))
        else:
            script.append(command + " --help >/dev/null")
    run(block, ["bash", "-e", "-o", "pipefail", "-c", "\n".join(script)], cwd, env)


@pytest.fixture
def port() -> int:
    return free_port()


@pytest.mark.processes
@pytest.mark.timeout(INSTALL_S + 600)
@pytest.mark.parametrize("page", PAGES)
def test_page_commands_run_on_a_fresh_clone(page: str, clone: Path, port: int) -> None:
    env = reader_env(port)
    if not (clone / ".venv/bin/python").exists():
        # A page read on its own (or before the README's): its reader has run the README's
        # install step first.
        subprocess.run(
            ["make", "install"],
            cwd=clone,
            env=env,
            check=True,
            capture_output=True,
            stdin=subprocess.DEVNULL,
            timeout=INSTALL_S,
        )
    server: Server | None = None
    ran = 0
    try:
        for block in (b for b in command_blocks() if b.page == page):
            text = block.text.replace("127.0.0.1:8000", f"127.0.0.1:{port}")
            text = text.replace("localhost:8000", f"localhost:{port}")
            if block.mode == "server":
                if server is not None:
                    server.stop()
                server = Server(block, text, clone, env, port)
            elif block.mode == "long":
                check_without_running(block, text, clone, env)
            elif block.mode == "run" and block.language == "python":
                run(block, [str(clone / ".venv/bin/python"), "-c", text], clone, env)
            elif block.mode == "run":
                run(block, ["bash", "-e", "-o", "pipefail", "-c", text], clone, env)
            else:
                continue
            ran += 1
    finally:
        if server is not None:
            server.stop()
    assert ran or page == "docs/agents.md", f"{page}: no command was run or checked"


@pytest.mark.processes
def test_a_command_that_would_not_paste_fails(port: int) -> None:
    """The reader's shell has no virtualenv on PATH: `dflash-gateway` alone is not found there
    (the mistake this test exists to catch), `.venv/bin/dflash-gateway` is."""
    env = reader_env(port)
    bare = Block("synthetic.md", 1, "bash", "dflash-gateway --help\n", "run", "")
    if shutil.which("dflash-gateway", path=env["PATH"]) is None:  # else installed system-wide
        with pytest.raises(AssertionError, match="exited 127"):
            run(bare, ["bash", "-e", "-c", bare.text], ROOT, env)
    explicit = Block("synthetic.md", 1, "bash", ".venv/bin/dflash-gateway --help\n", "run", "")
    run(explicit, ["bash", "-e", "-c", explicit.text], ROOT, env)
    long = Block("synthetic.md", 1, "bash", "make no-such-target\n", "long", "a reason")
    with pytest.raises(AssertionError, match="exited"):
        check_without_running(long, long.text, ROOT, env)
