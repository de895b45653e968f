"""The real Codex CLI (``@openai/codex``, pinned, installed from npm into ``.tools/`` by the test)
run headless (``codex exec --json``) against a real gateway in front of real emulators, with
``wire_api = "responses"`` in a temporary ``CODEX_HOME``/``HOME``: the config is the one the docs
give (``CONFIG``). Codex always streams, and it sends every field it uses on each request: the
gateway must understand all of them (none dropped), answer a simple prompt, and carry a tool call
(its ``exec_command`` shell tool) through the round trip. Against ``make run`` with less: only the
provider block and ``model_provider`` (Codex then asks for its own default model), or a model but
Codex's default hosted web search; each run ends with the one message docs/agents.md promises."""

from __future__ import annotations

import json
import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.conftest import Stack, emulator, gateway, make_run
from tests.support.procs import ManagedProcess, managed_processes
from tests.support.tools import npm_tool

pytestmark = pytest.mark.processes

DOCS = (Path(__file__).resolve().parents[2] / "docs" / "agents.md").read_text()

CODEX_VERSION = "0.171.0"  # docs/agents.md states it
MODEL = "moonshotai/Kimi-K2.5"
KEY = "sk-codex-e2e-0123456789abcdef"
# What a user puts in ~/.codex/config.toml (the base_url is theirs). web_search is a hosted tool
# nothing runs here; analytics and the update check would reach the internet.
CONFIG = """\
model = "moonshotai/Kimi-K2.5"
model_provider = "dflash"
model_context_window = 262144
web_search = "disabled"
check_for_update_on_startup = false

[analytics]
enabled = false

[model_providers.dflash]
name = "dflash-gateway"
base_url = "{url}/v1"
env_key = "DFLASH_API_KEY"
wire_api = "responses"
"""
# The least a user may write: the provider block and model_provider.
PROVIDER_ONLY = """\
model_provider = "dflash"

[model_providers.dflash]
name = "dflash-gateway"
base_url = "{url}/v1"
env_key = "DFLASH_API_KEY"
wire_api = "responses"
"""
WITH_A_MODEL = 'model = "moonshotai/Kimi-K2.5"\n' + PROVIDER_ONLY
# Codex 0.171 warns this on every run with a model its catalog lacks (docs/agents.md: why the
# gateway cannot serve what would silence it).
METADATA_WARNING = "Model metadata for `moonshotai/Kimi-K2.5` not found"


@pytest.fixture(scope="module")
def codex() -> str:
    return npm_tool("@openai/codex", CODEX_VERSION, "codex")


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, codex: str) -> Iterator[Stack]:
    with managed_processes(tmp_path_factory, "codex") as manager:
        emus = [emulator(manager, "emu-a"), emulator(manager, "emu-b")]
        yield Stack(gateway(manager, emus, env={"DFLASH_GATEWAY_API_KEYS": KEY}), emus)


def metric(gw: ManagedProcess, name: str, **labels: str) -> float:
    """The value of one series of the gateway's /metrics (0 when absent)."""
    headers = {"Authorization": f"Bearer {KEY}"}  # keys are configured: /metrics needs one
    text = httpx.get(gw.url + "/metrics", headers=headers, timeout=10).text
    wanted = [f'{k}="{v}"' for k, v in labels.items()]
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and all(w in line for w in wanted):
            total += float(line.rsplit(" ", 1)[1])
    return total


@pytest.fixture(scope="module")
def embedded(tmp_path_factory: pytest.TempPathFactory, codex: str) -> Iterator[ManagedProcess]:
    """``make run``'s gateway (no workers, no keys: its own emulated workers)."""
    with managed_processes(tmp_path_factory, "codex-make-run") as manager:
        yield make_run(manager)


def run_codex(
    codex: str,
    gw: ManagedProcess,
    tmp_path: Path,
    prompt: str,
    config: str = CONFIG,
    ok: bool = True,
) -> list[dict[str, Any]]:
    """``codex exec --json PROMPT`` in a fresh home with ``config``; its JSON events (exit status
    0 asserted when ``ok``, else not 0)."""
    home = tmp_path / "home"
    (home / ".codex").mkdir(parents=True)
    (home / ".codex" / "config.toml").write_text(config.format(url=gw.url))
    work = tmp_path / "work"
    work.mkdir()
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(home),
        "CODEX_HOME": str(home / ".codex"),
        "DFLASH_API_KEY": KEY,
        "NO_COLOR": "1",
    }
    argv = [codex, "exec", "--json", "--strict-config", "--skip-git-repo-check", "-C", str(work)]
    done = subprocess.run(
        [*argv, prompt],
        env=env,
        cwd=work,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert (done.returncode == 0) == ok, done.stdout[-2000:] + done.stderr[-2000:]
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def failure(events: list[dict[str, Any]]) -> str:
    """The message the failed turn ended with (what Codex shows its user)."""
    [failed] = [e for e in events if e.get("type") == "turn.failed"]
    return str(failed["error"]["message"])


def items(events: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [
        e["item"]
        for e in events
        if e.get("type") == "item.completed" and e["item"].get("type") == kind
    ]


def test_simple_prompt_streams_its_answer(codex: str, stack: Stack, tmp_path: Path) -> None:
    gw = stack.gw
    before = metric(gw, "dflash_gateway_stream_outcomes_total", outcome="ok")
    events = run_codex(codex, gw, tmp_path, "Say hello")
    [answer] = items(events, "agent_message")
    assert answer["text"].strip()
    # The reasoning came as streamed summary events, the usage with response.completed.
    assert items(events, "reasoning") and items(events, "reasoning")[0]["text"].strip()
    [turn] = [e for e in events if e.get("type") == "turn.completed"]
    assert turn["usage"]["input_tokens"] > 0 and turn["usage"]["output_tokens"] > 0
    assert turn["usage"]["reasoning_output_tokens"] > 0
    assert metric(gw, "dflash_gateway_stream_outcomes_total", outcome="ok") == before + 1
    # Every field Codex sent was understood: none dropped.
    dropped = "dflash_gateway_requests_with_dropped_fields_total"
    assert metric(gw, dropped, route="/v1/responses") == 0
    # The one error item is Codex's own metadata warning, which docs/agents.md explains.
    warnings = [item["message"] for item in items(events, "error")]
    assert len(warnings) == 1 and warnings[0].startswith(METADATA_WARNING), warnings


def test_tool_call_round_trip(codex: str, stack: Stack, tmp_path: Path) -> None:
    gw = stack.gw
    before = metric(gw, "dflash_gateway_requests_total", route="/v1/responses", status="200")
    events = run_codex(codex, gw, tmp_path, "Run exec_command with: echo codex-ok")
    [command] = items(events, "command_execution")
    assert command["status"] in ("completed", "failed")  # it ran; its exit status is the shell's
    assert re.search(r"\S", command["command"])
    answers = items(events, "agent_message")
    assert answers and answers[-1]["text"].strip()  # the model answered after the tool's output
    after = metric(gw, "dflash_gateway_requests_total", route="/v1/responses", status="200")
    assert after >= before + 2  # the call, then the answer to its output


def test_provider_block_only_ends_with_the_message_the_docs_promise(
    codex: str, embedded: ManagedProcess, tmp_path: Path
) -> None:
    """No model in the config: Codex asks for its own default (a GPT name). The gateway checks
    the model before the input, so the answer is the 404 that says what to set."""
    events = run_codex(codex, embedded, tmp_path, "Say hello", PROVIDER_ONLY, ok=False)
    message = failure(events)
    assert message.startswith("The model `gpt-"), message
    assert "moonshotai/Kimi-K2.5" in message and "set model" in message and "config.toml" in message
    assert message.split("`")[2] in DOCS  # docs/agents.md quotes it


def test_a_model_but_codexs_web_search_ends_with_the_setting_to_change(
    codex: str, embedded: ManagedProcess, tmp_path: Path
) -> None:
    """Codex offers its hosted web search unless told not to: refused, naming the setting."""
    events = run_codex(codex, embedded, tmp_path, "Say hello", WITH_A_MODEL, ok=False)
    message = failure(events)
    assert "'web_search' is a hosted tool" in message and 'web_search = \\"disabled\\"' in message
    assert 'web_search = "disabled"' in DOCS
