"""The openai SDK's Responses API (create, stream, parse, retrieve, delete, previous_response_id)
against real gateways in front of real emulators: one keeping responses in memory, one stateless
in front of the same workers, and two sharing one Redis."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pydantic
import pytest
from openai.types.responses import ResponseStreamEvent

from tests.e2e.conftest import Stack, emulator, gateway
from tests.support.procs import ManagedProcess, ProcessManager, managed_processes
from tests.support.tools import require_tool

pytestmark = pytest.mark.processes

MODEL = "moonshotai/Kimi-K2.5"
KEY, OTHER_KEY = "sk-responses-e2e-0123456789", "sk-responses-other-012345"
WEATHER: dict[str, Any] = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}
PATCH: dict[str, Any] = {
    "type": "custom",
    "name": "apply_patch",
    "description": "Edit files with a patch.",
    "format": {
        "type": "grammar",
        "syntax": "lark",
        "definition": 'start: "*** Begin Patch" LF body "*** End Patch"\nbody: /(.|\\n)*/',
    },
}
EVENTS: pydantic.TypeAdapter[Any] = pydantic.TypeAdapter(ResponseStreamEvent)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Stack, ManagedProcess]]:
    env = {
        "DFLASH_GATEWAY_API_KEYS": f"{KEY},{OTHER_KEY}",
        "DFLASH_GATEWAY_RESPONSES__STORE": "memory",
    }
    with managed_processes(tmp_path_factory, "responses") as manager:
        emus = [emulator(manager, "emu-a"), emulator(manager, "emu-b")]
        stored = gateway(manager, emus, env=env)
        stateless = gateway(manager, emus, env={"DFLASH_GATEWAY_API_KEYS": KEY})
        yield Stack(stored, emus), stateless


@pytest.fixture
def gw(stack: tuple[Stack, ManagedProcess]) -> Iterator[ManagedProcess]:
    stack[0].reset()
    yield stack[0].gw
    stack[0].reset()


@pytest.fixture
def client(gw: ManagedProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=gw.url + "/v1", api_key=KEY, max_retries=0) as sync_client:
        yield sync_client


def test_create_plain_thinks_then_answers(client: openai.OpenAI) -> None:
    out = client.responses.create(
        model=MODEL,
        instructions="Be brief.",
        input="What is the capital of France?",
        max_output_tokens=4000,
        metadata={"run": "e2e"},
    )
    assert out.object == "response" and out.status == "completed" and out.model == MODEL
    assert out.id.startswith("resp_") and out.metadata == {"run": "e2e"}
    assert [item.type for item in out.output] == ["reasoning", "message"]
    assert out.output_text and out.instructions == "Be brief."
    assert out.usage is not None and out.usage.input_tokens > 0
    assert out.usage.output_tokens >= out.usage.output_tokens_details.reasoning_tokens > 0
    assert out.usage.total_tokens == out.usage.input_tokens + out.usage.output_tokens


def test_reasoning_effort_none_turns_thinking_off_and_length_is_incomplete(
    client: openai.OpenAI,
) -> None:
    out = client.responses.create(
        model=MODEL, input="Tell me a story.", max_output_tokens=16, reasoning={"effort": "none"}
    )
    assert out.status == "incomplete"
    assert out.incomplete_details is not None
    assert out.incomplete_details.reason == "max_output_tokens"
    assert [item.type for item in out.output] == ["message"]  # no reasoning item
    assert out.usage is not None and out.usage.output_tokens == 16


def test_tool_round_trip_with_function_call_output(client: openai.OpenAI) -> None:
    first = client.responses.create(
        model=MODEL, input="Use get_weather for Paris.", tools=[WEATHER], max_output_tokens=4000
    )
    calls = [item for item in first.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    assert set(json.loads(calls[0].arguments)) == {"city"}
    follow = [
        {"role": "user", "content": "Use get_weather for Paris."},
        *[item.model_dump(exclude_none=True) for item in first.output],
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "Sunny, 21 C"},
    ]
    second = client.responses.create(
        model=MODEL,
        input=follow,
        tools=[WEATHER],
        max_output_tokens=4000,  # type: ignore[arg-type]
    )
    assert second.status == "completed"
    assert [item.type for item in second.output][-1] == "message" and second.output_text


def test_custom_tool_round_trip_with_custom_tool_call_output(client: openai.OpenAI) -> None:
    ask = "Use apply_patch to add hello.txt."
    first = client.responses.create(
        model=MODEL,
        input=ask,
        tools=[PATCH],
        max_output_tokens=4000,
    )
    assert first.status == "completed" and first.tools[0].type == "custom"
    calls = [item for item in first.output if item.type == "custom_tool_call"]
    assert len(calls) == 1 and calls[0].name == "apply_patch" and calls[0].call_id
    assert isinstance(calls[0].input, str) and calls[0].input  # the input itself, not JSON
    assert not calls[0].input.startswith('{"input"')
    assert not [item for item in first.output if item.type == "function_call"]
    follow = [
        {"role": "user", "content": ask},
        *[item.model_dump(exclude_none=True) for item in first.output],
        {"type": "custom_tool_call_output", "call_id": calls[0].call_id, "output": "Done"},
    ]
    second = client.responses.create(
        model=MODEL,
        input=follow,
        tools=[PATCH],
        max_output_tokens=4000,
    )
    assert second.status == "completed"
    assert second.output[-1].type == "message" and second.output_text
    # The same turn continued from the stored response: its call is part of the conversation.
    output = {"type": "custom_tool_call_output", "call_id": calls[0].call_id, "output": "Done"}
    third = client.responses.create(
        model=MODEL,
        previous_response_id=first.id,
        input=[output],
        tools=[PATCH],
        max_output_tokens=4000,
    )
    assert third.status == "completed" and third.output_text


def test_custom_tool_call_streams_its_input(client: openai.OpenAI) -> None:
    with client.responses.stream(
        model=MODEL,
        input="Use apply_patch to add hello.txt.",
        tools=[PATCH],
        max_output_tokens=4000,
    ) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [event.type for event in events]
    assert "response.function_call_arguments.delta" not in kinds
    deltas = [e.delta for e in events if e.type == "response.custom_tool_call_input.delta"]
    done = [e for e in events if e.type == "response.custom_tool_call_input.done"]
    assert len(done) == 1 and done[0].input == "".join(deltas) != ""
    assert [e.sequence_number for e in events] == list(range(len(events)))
    call = final.output[-1]
    assert call.type == "custom_tool_call" and call.name == "apply_patch"
    assert call.input == done[0].input and call.id == done[0].item_id
    added = [e.item for e in events if e.type == "response.output_item.added"]
    assert added[-1].type == "custom_tool_call" and added[-1].id == call.id


def test_json_schema_parsed(client: openai.OpenAI) -> None:
    class City(pydantic.BaseModel):
        name: str
        population: int

    out = client.responses.parse(
        model=MODEL, input="Describe Paris.", text_format=City, max_output_tokens=4000
    )
    assert isinstance(out.output_parsed, City)


def test_stream_events_are_the_sdks_own_types(client: openai.OpenAI, gw: ManagedProcess) -> None:
    body = {"model": MODEL, "input": "Use get_weather for Oslo.", "tools": [WEATHER]}
    body |= {"stream": True, "reasoning": {"effort": "high", "summary": "auto"}}
    events = []
    with httpx.stream(
        "POST", gw.url + "/v1/responses", json=body, headers={"authorization": f"Bearer {KEY}"}
    ) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        name = None
        for line in response.iter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                event = EVENTS.validate_python(json.loads(line[6:]), strict=False)
                assert event.type == name  # the event line names the data's own type
                events.append(event)
    kinds = [event.type for event in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    assert "response.reasoning_summary_text.delta" in kinds  # the summary Codex renders
    assert "response.function_call_arguments.delta" in kinds
    numbers = [event.sequence_number for event in events]
    assert numbers == list(range(len(events)))
    ids = {e.output_index: e.item.id for e in events if e.type == "response.output_item.added"}
    assert len(set(ids.values())) == len(ids) == 2  # the reasoning, then the call
    for event in events:
        if hasattr(event, "item_id"):
            assert ids[event.output_index] == event.item_id  # every part names its own item
    final = events[-1].response
    call = final.output[-1]
    assert call.type == "function_call" and call.name == "get_weather"
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert done[0].arguments == call.arguments
    assert final.usage.output_tokens > 0


def test_sdk_stream_helper_final_response(client: openai.OpenAI) -> None:
    with client.responses.stream(model=MODEL, input="Say hello.", max_output_tokens=4000) as stream:
        texts = [event.delta for event in stream if event.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert final.status == "completed" and final.output_text == "".join(texts)


def test_retrieve_delete_and_previous_response_id(
    client: openai.OpenAI, gw: ManagedProcess
) -> None:
    first = client.responses.create(model=MODEL, input="My name is Ada.", max_output_tokens=4000)
    got = client.responses.retrieve(first.id)
    assert got.id == first.id and got.output_text == first.output_text
    second = client.responses.create(
        model=MODEL, input="What is my name?", previous_response_id=first.id, max_output_tokens=4000
    )
    assert second.previous_response_id == first.id and second.status == "completed"
    assert second.usage is not None and first.usage is not None
    assert second.usage.input_tokens > first.usage.input_tokens  # the earlier turns were sent
    # Another key sees none of it.
    with openai.OpenAI(base_url=gw.url + "/v1", api_key=OTHER_KEY, max_retries=0) as other:
        with pytest.raises(openai.NotFoundError):
            other.responses.retrieve(first.id)
        with pytest.raises(openai.BadRequestError) as refused:
            other.responses.create(model=MODEL, input="Hi", previous_response_id=first.id)
        assert "previous_response_id" in refused.value.message
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)


def test_no_store_previous_response_id_is_a_clear_400(
    stack: tuple[Stack, ManagedProcess],
) -> None:
    stateless = stack[1]
    with openai.OpenAI(base_url=stateless.url + "/v1", api_key=KEY, max_retries=0) as client:
        out = client.responses.create(model=MODEL, input="Hi", store=True, max_output_tokens=50)
        with pytest.raises(openai.BadRequestError) as refused:
            client.responses.create(model=MODEL, input="Hi", previous_response_id=out.id)
        assert refused.value.body["param"] == "previous_response_id"  # type: ignore[index]
        assert "responses.store" in refused.value.message
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(out.id)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tools": [{"type": "web_search"}]}, "tools.0"),
        ({"tools": [{"type": "custom", "name": "patch",
                     "format": {"type": "grammar", "syntax": "peg", "definition": "x"}}]},
         "tools.0"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input.0"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}]},
         "input.0.content.0"),
        ({"background": True}, "background"),
        ({"truncation": "auto"}, "truncation"),
        ({"text": {"format": {"type": "json_schema", "name": "x", "schema": 3}}}, "text"),
    ],
)  # fmt: skip
def test_what_cannot_be_honoured_is_a_400_naming_it(
    gw: ManagedProcess, body: dict[str, Any], param: str
) -> None:
    request = {"model": MODEL, "input": "Hi", **body}
    response = httpx.post(
        gw.url + "/v1/responses", json=request, headers={"authorization": f"Bearer {KEY}"}
    )
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param


def test_previous_response_id_across_gateways_sharing_redis(
    procs: ProcessManager, stack: tuple[Stack, ManagedProcess]
) -> None:
    server = require_tool("redis-server")
    redis = procs.start(
        [server, "--port", "{port}", "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        name="redis",
        ready_path=None,
    )
    url = f"redis://127.0.0.1:{redis.port}/0"
    env = {
        "DFLASH_GATEWAY_API_KEYS": KEY,
        "DFLASH_GATEWAY_RESPONSES__STORE": "redis",
        "DFLASH_GATEWAY_LIMITS__REDIS_URL": url,
    }
    emus = stack[0].emus
    one, two = gateway(procs, emus, env=env), gateway(procs, emus, env=env)
    with (
        openai.OpenAI(base_url=one.url + "/v1", api_key=KEY, max_retries=0) as first_client,
        openai.OpenAI(base_url=two.url + "/v1", api_key=KEY, max_retries=0) as second_client,
    ):
        first = first_client.responses.create(model=MODEL, input="Hi", max_output_tokens=4000)
        second = second_client.responses.create(
            model=MODEL, input="And now?", previous_response_id=first.id, max_output_tokens=4000
        )
        assert second.status == "completed"
        assert second_client.responses.retrieve(first.id).id == first.id


def input_items_and_item_references(client: openai.OpenAI) -> None:
    """``responses.input_items.list`` and ``item_reference`` input items through the SDK: a
    reference to an item of the previous response is sent as that item; input_items lists a
    response's own input (ids kept or given), newest first by default, page by page."""
    ada = {"type": "message", "role": "user", "content": "My name is Ada.", "id": "msg_ada"}
    first = client.responses.create(
        model=MODEL, input=[ada, {"role": "user", "content": "Hi."}], max_output_tokens=4000
    )
    listed = client.responses.input_items.list(first.id, order="asc")
    assert listed.data[0].id == "msg_ada" and len(listed.data) == 2
    assert listed.data[1].id.startswith("msg_")  # an id the gateway gave it
    newest = client.responses.input_items.list(first.id, limit=1)  # desc by default
    assert [item.id for item in newest.data] == [listed.data[1].id] and newest.has_more
    rest = client.responses.input_items.list(first.id, limit=1, after=newest.data[0].id)
    assert [item.id for item in rest.data] == ["msg_ada"] and not rest.has_more
    second = client.responses.create(
        model=MODEL,
        previous_response_id=first.id,
        input=[
            {"type": "item_reference", "id": "msg_ada"},
            {"role": "user", "content": "What is my name?"},
        ],
        max_output_tokens=4000,
    )
    assert second.status == "completed"
    assert second.usage is not None and first.usage is not None
    assert second.usage.input_tokens > first.usage.input_tokens  # the referenced item was sent
    got = client.responses.input_items.list(second.id, order="asc").data
    assert got[0].id == "msg_ada"
    assert got[0].content[0].text == "My name is Ada."  # type: ignore[union-attr]
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(
            model=MODEL,
            previous_response_id=first.id,
            input=[{"type": "item_reference", "id": "msg_nowhere"}],
        )
    assert refused.value.body["param"] == "input.0.id"  # type: ignore[index]
    with pytest.raises(openai.NotFoundError):
        client.responses.input_items.list("resp_nowhere")


def test_input_items_and_item_references_in_memory(client: openai.OpenAI) -> None:
    input_items_and_item_references(client)


def test_input_items_and_item_references_in_redis(
    procs: ProcessManager, stack: tuple[Stack, ManagedProcess]
) -> None:
    server = require_tool("redis-server")
    redis = procs.start(
        [server, "--port", "{port}", "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        name="redis",
        ready_path=None,
    )
    env = {
        "DFLASH_GATEWAY_API_KEYS": KEY,
        "DFLASH_GATEWAY_RESPONSES__STORE": "redis",
        "DFLASH_GATEWAY_LIMITS__REDIS_URL": f"redis://127.0.0.1:{redis.port}/0",
    }
    gw = gateway(procs, stack[0].emus, env=env)
    with openai.OpenAI(base_url=gw.url + "/v1", api_key=KEY, max_retries=0) as client:
        input_items_and_item_references(client)
