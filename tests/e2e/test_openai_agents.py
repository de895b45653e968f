"""The openai-agents SDK's default model (the Responses API) running one tool-using turn against a
real gateway in front of real emulators: the agent calls its function tool, gets the result back
to the model, and ends with the model's answer. Tracing is off (it would export to OpenAI)."""

from __future__ import annotations

from collections.abc import Iterator

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
