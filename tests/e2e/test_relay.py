"""Through the gateway the OpenAI SDK and curl see exactly what the worker sent, as it is sent."""

from __future__ import annotations

import shutil
import subprocess
from typing import Any

import httpx
import pytest
from openai import AsyncOpenAI, OpenAI

from tests.e2e.conftest import Stack, poll

MODEL = "moonshotai/Kimi-K2.5"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city"],
            },
        },
    }
]
CASES: dict[str, dict[str, Any]] = {
    "reasoning": {"messages": [{"role": "user", "content": "Why is the sky blue?"}]},
    "tool_call": {
        "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
        "tools": TOOLS,
        "tool_choice": "required",
    },
}


_VARYING = ("id", "created", "prompt_tokens_details")


def _norm(obj: Any) -> Any:
    """Drop what legitimately differs per request: the rid-based id, the timestamp, and the
    prompt-cache hit count (worker state: which worker, what it served before)."""
    if isinstance(obj, dict):
        return {k: _norm(v) for k, v in obj.items() if k not in _VARYING}
    if isinstance(obj, list):
        return [_norm(v) for v in obj]
    return obj


def _request(case: str, **extra: Any) -> dict[str, Any]:
    # A request seed makes the emulator's output a function of the prompt alone.
    return {"model": MODEL, "seed": 7, "max_tokens": 4000, **CASES[case], **extra}


def _sync(base: str, body: dict[str, Any]) -> Any:
    client = OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
    with client:
        kwargs = dict(body)
        if kwargs.get("stream"):
            return [c.model_dump() for c in client.chat.completions.create(**kwargs)]
        return client.chat.completions.create(**kwargs).model_dump()


async def _async(base: str, body: dict[str, Any]) -> Any:
    async with AsyncOpenAI(base_url=base + "/v1", api_key="unused", max_retries=0) as client:
        if body.get("stream"):
            stream = await client.chat.completions.create(**body)
            return [c.model_dump() async for c in stream]
        return (await client.chat.completions.create(**body)).model_dump()


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize(
    "mode",
    [{}, {"stream": True}, {"stream": True, "stream_options": {"include_usage": True}}],
    ids=["whole", "stream", "stream+usage"],
)
async def test_sdk_sees_through_the_gateway_what_it_sees_directly(
    fresh: Stack, case: str, mode: dict[str, Any]
) -> None:
    body = _request(case, **mode)
    direct = _sync(fresh.emus[0].url, body)
    via_sync = _sync(fresh.gw.url, body)
    via_async = await _async(fresh.gw.url, body)
    assert _norm(via_sync) == _norm(direct)
    assert _norm(via_async) == _norm(direct)
    if mode.get("stream"):
        deltas = [c["choices"][0]["delta"] for c in direct if c["choices"]]
        assert any(d.get("reasoning_content") for d in deltas)
        if case == "tool_call":
            assert any(d.get("tool_calls") for d in deltas)
        assert bool(direct[-1]["usage"]) == bool(mode.get("stream_options"))
    else:
        message = direct["choices"][0]["message"]
        assert message["reasoning_content"]
        assert bool(message["tool_calls"]) == (case == "tool_call")


def test_raw_stream_bytes_match_apart_from_the_rid(fresh: Stack) -> None:
    body = _request("reasoning", stream=True, stream_options={"include_usage": True})
    direct = httpx.post(fresh.emus[0].url + "/v1/chat/completions", json=body, timeout=30)
    via = httpx.post(fresh.gw.url + "/v1/chat/completions", json=body, timeout=30)
    assert via.headers["content-type"] == "text/event-stream"
    assert via.headers["cache-control"] == "no-cache"
    assert via.headers["x-accel-buffering"] == "no"
    rid_direct = direct.text.split('"id":"', 1)[1].split('"', 1)[0]
    rid_via = via.text.split('"id":"', 1)[1].split('"', 1)[0]
    created = '"created":'

    def strip(text: str, rid: str) -> str:
        out = text.replace(rid, "RID")
        return "".join(p.split(",", 1)[-1] if i else p for i, p in enumerate(out.split(created)))

    assert strip(via.text, rid_via) == strip(direct.text, rid_direct)
    assert via.text.endswith("data: [DONE]\n\n")


def _hold(stack: Stack, k: int) -> None:
    for emu in stack.emus:
        stack.control(emu, "/emulator/gate", {"hold_after_chunks": k})


def _held(stack: Stack) -> int:
    return sum(httpx.get(e.url + "/emulator/gate", timeout=5).json()["held"] for e in stack.emus)


def test_no_buffering_chunk_k_arrives_while_the_worker_holds(fresh: Stack) -> None:
    k = 3
    _hold(fresh, k)
    body = _request("reasoning", stream=True)
    with (
        httpx.Client(timeout=30) as client,
        client.stream("POST", fresh.gw.url + "/v1/chat/completions", json=body) as response,
    ):
        events: list[str] = []
        lines = response.iter_lines()
        while len(events) < k:
            line = next(lines)
            if line.startswith("data: "):
                events.append(line)
        # k events are here and the worker is still holding the stream after its k-th event.
        assert _held(fresh) == 1
        assert "[DONE]" not in events[-1]
        fresh.control(fresh.emus[0], "/emulator/gate", {"release": True})
        fresh.control(fresh.emus[1], "/emulator/gate", {"release": True})
        rest = [line for line in lines if line.startswith("data: ")]
    assert rest[-1] == "data: [DONE]"


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl not installed")
def test_curl_prints_chunks_incrementally(fresh: Stack) -> None:
    k = 2
    _hold(fresh, k)
    body = '{"model": "kimi-k2.5", "stream": true, "messages": [{"role": "user", "content": "hi"}]}'
    cmd = ["curl", "-sN", fresh.gw.url + "/v1/chat/completions"]
    cmd += ["-H", "Content-Type: application/json", "-d", body]
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True) as curl:
        assert curl.stdout is not None
        seen = 0
        while seen < k:
            line = curl.stdout.readline()
            assert line, "curl ended early"
            seen += line.startswith("data: ")
        assert _held(fresh) == 1  # curl printed k events while the worker still holds
        for emu in fresh.emus:
            fresh.control(emu, "/emulator/gate", {"release": True})
        rest = curl.stdout.read()
        assert curl.wait(timeout=30) == 0
    assert rest.rstrip().endswith("data: [DONE]")


def test_client_disconnect_aborts_on_the_worker_and_in_flight_returns_to_zero(
    fresh: Stack,
) -> None:
    _hold(fresh, 2)
    body = _request("reasoning", stream=True)
    before = {e.url: fresh.stats(e)["totals"]["aborted"] for e in fresh.emus}
    client = httpx.Client(timeout=30)
    with client.stream("POST", fresh.gw.url + "/v1/chat/completions", json=body) as response:
        lines = response.iter_lines()
        while not next(lines).startswith("data: "):
            pass
        poll(lambda: _held(fresh) == 1)
        worker = next(url for url, n in fresh.in_flight().items() if n == 1)
    client.close()  # the client goes away mid-stream

    emu = next(e for e in fresh.emus if e.url == worker)

    def aborted() -> list[dict[str, Any]]:
        return [r for r in fresh.stats(emu)["requests"] if r["aborted"] == "abort"]

    poll(lambda: fresh.stats(emu)["totals"]["aborted"] > before[worker], timeout=5)
    assert aborted()
    poll(lambda: fresh.in_flight()[worker] == 0, timeout=5)
