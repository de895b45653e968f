"""The real Claude Code CLI (``@anthropic-ai/claude-code`` from npm, pinned) against a gateway in
front of two emulated workers, run headless the way docs/agents.md says to point it at the
gateway: a simple prompt, a prompt that makes it call a tool (the round trip completes), and its
streams; and against ``make run`` (``dflash-gateway serve``, the embedded default) given only the
base URL and a token, as a new user tries it first.

The CLI is installed into ``.tools/npm/`` on first use (``tests.support.tools.npm_tool``);
without ``npm`` these tests are skipped (they fail under ``DFLASH_REQUIRE_TOOLS=1``). It runs with
a temporary ``HOME`` and no telemetry or other traffic than the gateway's, from a clean
environment (nothing of the caller's ``ANTHROPIC_*`` settings).
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from tests.e2e.conftest import emulator, gateway, make_run
from tests.support.procs import ManagedProcess, managed_processes
from tests.support.tools import npm_tool

pytestmark = pytest.mark.processes

PACKAGE, VERSION = "@anthropic-ai/claude-code", "2.1.337"  # docs/agents.md states it
MODEL = "moonshotai/Kimi-K2.5"
KEY = "sk-claude-code-e2e-0123456789"
QUIET = {"DISABLE_TELEMETRY": "1", "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1"}


@pytest.fixture(scope="module")
def claude() -> str:
    return npm_tool(PACKAGE, VERSION, "claude")


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ManagedProcess]:
    with managed_processes(tmp_path_factory, "claude-code") as manager:
        emus = [emulator(manager, "emu-a"), emulator(manager, "emu-b")]
        env = {"DFLASH_GATEWAY_API_KEYS": KEY, "DFLASH_GATEWAY_LOG_JSON": "1"}
        yield gateway(manager, emus, env=env)


@pytest.fixture(scope="module")
def embedded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ManagedProcess]:
    """``make run``'s gateway (no workers, no keys: its own emulated workers)."""
    with managed_processes(tmp_path_factory, "claude-code-make-run") as manager:
        yield make_run(manager, {"DFLASH_GATEWAY_LOG_JSON": "1"})


@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str
    requests: list[dict[str, Any]]  # the gateway's access lines of this run

    def events(self) -> list[dict[str, Any]]:
        """stdout as ``--output-format stream-json`` lines."""
        return [json.loads(line) for line in self.stdout.splitlines() if line.strip()]


def run_claude(
    claude: str, gw: ManagedProcess, tmp_path: Path, prompt: str, *args: str, **env: str
) -> Run:
    """``claude -p PROMPT ARGS`` in an empty project directory with ``env`` (the README's
    variables) on top of a clean, quiet environment; the gateway's access lines it caused."""
    home, project = tmp_path / "home", tmp_path / "project"
    home.mkdir()
    project.mkdir(exist_ok=True)
    before = len(gw.logs().splitlines())
    clean = {"PATH": os.environ["PATH"], "HOME": str(home), "LANG": "C.UTF-8", **QUIET, **env}
    done = subprocess.run(
        [claude, "-p", prompt, *args],
        cwd=project,
        env=clean,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=240,
    )
    lines = gw.logs().splitlines()[before:]
    access = [orjson.loads(line) for line in lines if '"dflash_gateway.access"' in line]
    return Run(done.returncode, done.stdout, done.stderr, access)


def readme_env(gw: ManagedProcess, key_variable: str) -> dict[str, str]:
    """README, "Pointing Claude Code at the gateway"."""
    return {"ANTHROPIC_BASE_URL": gw.url, key_variable: KEY, "ANTHROPIC_MODEL": MODEL}


def test_make_run_answers_claude_code_given_only_a_base_url_and_a_token(
    claude: str, embedded: ManagedProcess, tmp_path: Path
) -> None:
    """No ANTHROPIC_MODEL: Claude Code sends its own default (claude-opus-...), which the
    embedded default's ``claude-*`` alias serves; the answer carries the name it asked for."""
    env = {"ANTHROPIC_BASE_URL": embedded.url, "ANTHROPIC_AUTH_TOKEN": "any-token"}
    run = run_claude(
        claude,
        embedded,
        tmp_path,
        "Say hello",
        "--output-format",
        "stream-json",
        "--verbose",
        **env,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    events = run.events()
    final = events[-1]
    assert (final["type"], final["subtype"], final["is_error"]) == ("result", "success", False)
    assert final["result"].strip()
    asked = {e["message"]["model"] for e in events if e["type"] == "assistant"}
    assert asked and all(name.startswith("claude-") for name in asked), asked
    messages = [r for r in run.requests if r["route"] == "/v1/messages"]
    assert messages and all(r["status"] == 200 for r in messages), run.requests
    assert all(r["model"] == MODEL for r in messages)  # served by the emulated Kimi-K2.5


def test_a_simple_prompt(claude: str, gw: ManagedProcess, tmp_path: Path) -> None:
    run = run_claude(claude, gw, tmp_path, "Say hello", **readme_env(gw, "ANTHROPIC_AUTH_TOKEN"))
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip()
    messages = [r for r in run.requests if r["route"] == "/v1/messages"]
    assert messages, run.requests
    # It answers in a few turns: no tool is called on its reminders' say-so, nothing refused.
    assert len(messages) <= 3, messages
    assert all(r["status"] == 200 and r["model"] == MODEL for r in messages), messages
    assert all(r["stream"] for r in messages)  # Claude Code streams by default


def test_a_tool_round_trip(claude: str, gw: ManagedProcess, tmp_path: Path) -> None:
    (tmp_path / "project").mkdir()
    (tmp_path / "project" / "notes.txt").write_text("hello from notes\n")
    env = {**readme_env(gw, "ANTHROPIC_API_KEY"), "ANTHROPIC_SMALL_FAST_MODEL": MODEL}
    run = run_claude(
        claude,
        gw,
        tmp_path,
        "Use Read to open notes.txt",
        "--output-format",
        "stream-json",
        "--verbose",
        **env,
    )
    assert run.returncode == 0, run.stderr
    events = run.events()
    blocks = [
        (event["type"], block)
        for event in events
        if event["type"] in ("assistant", "user")
        for block in event["message"]["content"]
        if isinstance(block, dict)
    ]
    uses = [block for kind, block in blocks if kind == "assistant" and block["type"] == "tool_use"]
    assert [use["name"] for use in uses] == ["Read"], blocks
    results = [block for kind, block in blocks if block.get("type") == "tool_result"]
    assert [result["tool_use_id"] for result in results] == [uses[0]["id"]]
    after = blocks[blocks.index(("user", results[0])) :]
    assert any(kind == "assistant" and block["type"] == "text" for kind, block in after)
    final = events[-1]
    assert (final["type"], final["subtype"], final["is_error"]) == ("result", "success", False)
    assert final["result"].strip()
    # The gateway's side: the call, then the answer to its result; nothing refused.
    messages = [r for r in run.requests if r["route"] == "/v1/messages"]
    assert len(messages) == 2 and all(r["status"] == 200 for r in messages), messages


def test_the_answer_streams(claude: str, gw: ManagedProcess, tmp_path: Path) -> None:
    run = run_claude(
        claude,
        gw,
        tmp_path,
        "Say hello",
        "--output-format",
        "stream-json",
        "--verbose",
        "--include-partial-messages",
        **readme_env(gw, "ANTHROPIC_AUTH_TOKEN"),
    )
    assert run.returncode == 0, run.stderr
    events = run.events()
    stream = [e["event"] for e in events if e["type"] == "stream_event"]
    kinds = [e["type"] for e in stream]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop", kinds
    deltas = [
        e["delta"]["text"]
        for e in stream
        if e["type"] == "content_block_delta" and e["delta"]["type"] == "text_delta"
    ]
    assert len(deltas) > 1  # piece by piece, as the worker generated it
    final = events[-1]
    assert final["type"] == "result" and final["result"] == "".join(deltas)


def test_without_anthropic_model_the_refusal_names_the_model_it_asked_for(
    claude: str, gw: ManagedProcess, tmp_path: Path
) -> None:
    """A gateway with real workers serves no ``claude-*`` names unless told to. Its 404 (in
    Anthropic's shape, as Anthropic answers an unknown model) says to set ANTHROPIC_MODEL; Claude
    Code shows its own text for any 404 instead, naming the model it sent and ``--model``."""
    env = {"ANTHROPIC_BASE_URL": gw.url, "ANTHROPIC_AUTH_TOKEN": KEY}
    run = run_claude(claude, gw, tmp_path, "Say hello", **env)
    assert run.returncode != 0
    shown = run.stdout + run.stderr
    assert "issue with the selected model (claude-" in shown and "--model" in shown, shown
    refused = [r for r in run.requests if r["route"] == "/v1/messages"]
    assert refused and all(r["status"] == 404 for r in refused), run.requests
    # What the gateway answered it (an Anthropic SDK shows the message as it is).
    body = {
        "model": "claude-opus-5-5",
        "max_tokens": 8,
        "messages": [{"role": "user", "content": "hi"}],
    }
    answer = httpx.post(gw.url + "/v1/messages", json=body, headers={"x-api-key": KEY}, timeout=10)
    message = answer.json()["error"]["message"]
    assert answer.status_code == 404 and "ANTHROPIC_MODEL" in message and MODEL in message
