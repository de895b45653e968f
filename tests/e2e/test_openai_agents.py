"""The openai-agents SDK's default model (the Responses API) running one tool-using turn against a
real gateway in front of real emulators: the agent calls its function tool, gets the result back
to the model, and ends with the model's answer. Tracing is off (it would export to OpenAI). And
docs/agents.md's recipe, run as it is, with every connection outside the gateway sent to a
blackhole that counts them: none (without its tracing line, the exporter does connect)."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from agents import (
    Agent,
    Runner,
    function_tool,
    set_default_openai_api,
    set_default_openai_client,
    set_tracing_disabled,
)
from agents.items import ToolCallItem, ToolCallOutputItem

from tests.e2e.conftest import Stack, emulator, gateway
from tests.support.procs import managed_processes

pytestmark = pytest.mark.processes

# The agents SDK reads "moonshotai/..." as a provider prefix: the gateway serves an alias.
MODEL = "kimi-k2.5"
KEY = "sk-agents-e2e-0123456789abcdef"
ENV = {
    "DFLASH_GATEWAY_API_KEYS": KEY,
    "DFLASH_GATEWAY_MODEL_ALIASES": f"{MODEL}=moonshotai/Kimi-K2.5",
}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with managed_processes(tmp_path_factory, "agents") as manager:
        emus = [emulator(manager, "emu-a")]
        yield Stack(gateway(manager, emus, env=ENV), emus)


async def test_one_tool_using_turn_on_the_default_responses_model(stack: Stack) -> None:
    cities: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        cities.append(city)
        return f"Sunny and 21 C in {city}."

    client = openai.AsyncOpenAI(base_url=stack.gw.url + "/v1", api_key=KEY, max_retries=0)
    set_tracing_disabled(True)
    set_default_openai_client(client, use_for_tracing=False)
    set_default_openai_api("responses")
    agent = Agent(name="weather", instructions="Answer briefly.", model=MODEL, tools=[get_weather])
    try:
        result = await Runner.run(agent, "Use get_weather for Paris.", max_turns=4)
    finally:
        await client.close()
    assert len(cities) == 1  # the model's call reached the tool, with a city
    kinds = [type(item) for item in result.new_items]
    assert ToolCallItem in kinds and ToolCallOutputItem in kinds
    assert isinstance(result.final_output, str) and result.final_output.strip()
    assert len(result.raw_responses) == 2  # the call, then the answer to its output


class Blackhole:
    """A listener on loopback that counts every connection made to it and answers none: the
    proxy (``HTTPS_PROXY``/``HTTP_PROXY``) and the ``OPENAI_BASE_URL`` of a script that must
    talk to nothing but the gateway."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.seen: list[bytes] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(2)
                with contextlib.suppress(OSError):
                    self.seen.append(conn.recv(200).split(b"\r\n", 1)[0])


def docs_recipe() -> str:
    text = (Path(__file__).resolve().parents[2] / "docs" / "agents.md").read_text()
    section = text[text.index("## openai-agents") :]
    return section.split("```python\n", 1)[1].split("```", 1)[0]


def run_recipe(code: str, stack: Stack, hole: Blackhole) -> subprocess.CompletedProcess[str]:
    code = code.replace("http://127.0.0.1:8000", stack.gw.url).replace("sk-your-gateway-key", KEY)
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": os.environ.get("HOME", "/tmp"),
        "HTTPS_PROXY": hole.url,
        "HTTP_PROXY": hole.url,
        "ALL_PROXY": hole.url,
        "NO_PROXY": "127.0.0.1:" + stack.gw.url.rsplit(":", 1)[1],  # the gateway only
        "OPENAI_BASE_URL": hole.url + "/v1",
        "OPENAI_API_KEY": KEY,
    }
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )


def test_the_docs_recipe_sends_nothing_outside_the_gateway(stack: Stack) -> None:
    hole = Blackhole()
    done = run_recipe(docs_recipe(), stack, hole)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip()  # the model's answer
    time.sleep(1)  # a late export would have connected by now
    assert hole.seen == []


def test_without_its_tracing_line_the_recipe_would_leak_the_key(stack: Stack) -> None:
    """What the recipe's tracing line prevents: the SDK's exporter reaching out (to OpenAI's
    trace endpoint, through the proxy) at exit."""
    hole = Blackhole()
    leaky = docs_recipe().replace("set_tracing_disabled(True)", "pass")
    leaky = leaky.replace("use_for_tracing=False", "use_for_tracing=True")
    run_recipe(leaky, stack, hole)
    assert hole.seen, "the exporter never connected"
    assert any(b"api.openai.com" in line for line in hole.seen), hole.seen
