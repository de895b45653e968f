"""A mixed fleet with real processes: two emulated vLLM workers (``emulate --engine vllm``) and one
emulated SGLang worker behind one gateway that detects each engine itself. Clients (the OpenAI
SDK, curl, the Anthropic SDK) are served whatever engine answers; the gateway reads each worker's
acceptance length and throughput its own way; vLLM workers are held at their own max-num-seqs,
fail over like SGLang ones, and are aborted by closing the connection."""

from __future__ import annotations

import contextlib
import re
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import anthropic
import httpx
import openai
import pytest

from tests.e2e.conftest import emulator, gateway, poll
from tests.support.procs import ManagedProcess, ProcessManager, managed_processes

CHAT = "/v1/chat/completions"
FAST_LOADS = {"DFLASH_GATEWAY_HEALTH__LOADS_INTERVAL_S": "0.3"}


def _vllm(procs: ProcessManager, name: str, *args: str) -> ManagedProcess:
    return emulator(procs, name, "--engine", "vllm", *args)


def _workers(gw: ManagedProcess) -> dict[str, dict[str, Any]]:
    return {w["url"]: w for w in httpx.get(gw.url + "/workers", timeout=5).json()["workers"]}


def _stats(emu: ManagedProcess) -> dict[str, Any]:
    response = httpx.get(emu.url + "/emulator/stats", params={"limit": 0}, timeout=5)
    return response.json()  # type: ignore[no-any-return]


def _gate(emu: ManagedProcess, body: dict[str, Any]) -> None:
    httpx.post(emu.url + "/emulator/gate", json=body, timeout=5).raise_for_status()


def _metric(text: str, name: str, worker: str) -> float | None:
    labels = f'role="whole",worker="{re.escape(worker)}"'
    found = re.search(rf"^dflash_gateway_{name}{{{labels}}} (\S+)$", text, re.M)
    return float(found.group(1)) if found else None


def _name(emu: ManagedProcess) -> str:
    return emu.url.removeprefix("http://")


def _body(i: int, *, stream: bool = True, max_tokens: int = 64) -> dict[str, Any]:
    return {
        "model": "kimi-k2.5",
        "messages": [{"role": "user", "content": f"Question {i}: explain step {i} briefly."}],
        "max_tokens": max_tokens,
        "stream": stream,
    }


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[ManagedProcess]]:
    """[gateway, vllm-a, vllm-b, sglang], the engines detected (workers.engine = auto)."""
    with managed_processes(tmp_path_factory, "vllm") as manager:
        emus = [
            _vllm(manager, "vllm-a", "--seed", "1", "--max-num-seqs", "6", "--vllm-dev-mode"),
            _vllm(manager, "vllm-b", "--seed", "2", "--max-num-seqs", "6", "--vllm-dev-mode"),
            emulator(manager, "sglang", "--seed", "3"),
        ]
        # round_robin: sequential requests reach every worker, so every engine serves each client.
        env = {**FAST_LOADS, "DFLASH_GATEWAY_POLICY": "round_robin"}
        yield [gateway(manager, emus, env=env), *emus]


def test_each_worker_engine_is_detected_with_its_own_capacity(
    fleet: list[ManagedProcess],
) -> None:
    gw, vllm_a, vllm_b, sglang = fleet
    poll(lambda: all(w["state"] == "healthy" for w in _workers(gw).values()), timeout=15)
    table = _workers(gw)
    assert [table[e.url]["engine"] for e in (vllm_a, vllm_b, sglang)] == ["vllm", "vllm", "sglang"]
    # vLLM's max_num_seqs (its /server_info), SGLang's max_running_requests (/v1/loads).
    assert table[vllm_a.url]["capacity"]["admission_cap"] == 6
    assert table[sglang.url]["capacity"]["admission_cap"] == 48
    text = httpx.get(gw.url + "/metrics", timeout=5).text
    info = "dflash_gateway_worker_engine_info"
    assert f'{info}{{engine="vllm",role="whole",worker="{_name(vllm_a)}"}} 1.0' in text
    assert f'{info}{{engine="sglang",role="whole",worker="{_name(sglang)}"}} 1.0' in text


def test_openai_sdk_curl_and_anthropic_are_served_by_every_engine(
    fleet: list[ManagedProcess],
) -> None:
    gw, *emus = fleet
    before = [_stats(e)["totals"]["requests"] for e in emus]
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0)
    claude = anthropic.Anthropic(base_url=gw.url, api_key="unused", max_retries=0)
    for i in range(6):
        done = client.chat.completions.create(**_body(i, stream=False))  # type: ignore[call-overload]
        assert done.choices[0].finish_reason in ("stop", "length")
        assert done.usage is not None and done.usage.completion_tokens > 0
        chunks = list(client.chat.completions.create(**_body(i)))  # type: ignore[call-overload]
        assert any(c.choices and c.choices[0].finish_reason for c in chunks)
        message = claude.messages.create(
            model="kimi-k2.5",
            max_tokens=64,
            thinking={"type": "enabled", "budget_tokens": 32},
            messages=[{"role": "user", "content": f"Think about {i}."}],
        )
        # Reasoning reaches the Anthropic client as thinking whichever engine named it
        # (SGLang's reasoning_content, vLLM's reasoning).
        assert message.content and message.content[0].type == "thinking", message.content
        with claude.messages.stream(
            model="kimi-k2.5",
            max_tokens=64,
            thinking={"type": "enabled", "budget_tokens": 32},
            messages=[{"role": "user", "content": f"Think again about {i}."}],
        ) as stream:
            final = stream.get_final_message()
        assert final.content and final.content[0].type == "thinking", final.content
    if shutil.which("curl"):
        body = (
            '{"model": "kimi-k2.5", "stream": true, "max_tokens": 16, '
            '"messages": [{"role": "user", "content": "hi"}]}'
        )
        for _ in range(3):
            out = subprocess.run(
                ["curl", "-sN", gw.url + CHAT, "-H", "Content-Type: application/json", "-d", body],
                capture_output=True,
                text=True,
                timeout=30,
                check=True,
            ).stdout
            assert out.rstrip().endswith("data: [DONE]")
    after = [_stats(e)["totals"]["requests"] for e in emus]
    assert all(a > b for a, b in zip(after, before, strict=True)), (before, after)


def test_acceptance_and_throughput_per_worker_for_both_engines(procs: ProcessManager) -> None:
    """A fresh fleet (so the gateway's 60 s acceptance window covers all of the emulators'
    traffic): each worker's acceptance length and throughput show in /metrics; the vLLM ones
    are read from its spec-decode counters within 5 % of the emulator's own acceptance."""
    emus = [
        _vllm(procs, "vllm-a", "--seed", "11", "--max-num-seqs", "8"),
        _vllm(procs, "vllm-b", "--seed", "12", "--max-num-seqs", "8"),
        emulator(procs, "sglang", "--seed", "13"),
    ]
    # least_inflight: every worker must get traffic to show its figures; a capacity-aware policy
    # rightly prefers the vLLM workers here (256 reported slots against SGLang's 48).
    gw = gateway(procs, emus, env={**FAST_LOADS, "DFLASH_GATEWAY_POLICY": "least_inflight"})
    poll(lambda: all(w["state"] == "healthy" for w in _workers(gw).values()), timeout=15)
    seen_throughput: dict[str, float] = {}
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            text = httpx.get(gw.url + "/metrics", timeout=5).text
            for emu in emus:
                rate = _metric(text, "worker_output_throughput_tokens_per_second", _name(emu))
                if rate:
                    seen_throughput[emu.url] = max(seen_throughput.get(emu.url, 0.0), rate)
            time.sleep(0.1)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        with ThreadPoolExecutor(6) as pool:
            statuses = list(
                pool.map(
                    lambda i: (
                        httpx.post(
                            gw.url + CHAT, json=_body(i, max_tokens=200), timeout=60
                        ).status_code
                    ),
                    range(36),
                )
            )
        assert statuses == [200] * 36

        def shown() -> bool:
            """What the asserts below read, as load polls after the last request show it (the
            figures are polled, so they are waited for; on time out the asserts say which)."""
            text = httpx.get(gw.url + "/metrics", timeout=5).text
            for emu in emus:
                name = _name(emu)
                if not seen_throughput.get(emu.url) or not all(
                    _metric(text, family, name)
                    for family in ("worker_spec_accept_length", "worker_measured_accept_length")
                ):
                    return False
            for emu in emus[:2]:
                truth = _stats(emu)["totals"]["token_weighted_accept_length"]
                figure = _metric(text, "worker_spec_accept_length", _name(emu))
                if not truth or not figure or abs(figure - truth) > 0.05 * truth:
                    return False
            return True

        with contextlib.suppress(AssertionError):
            poll(shown, timeout=20, interval=0.2)
    finally:
        stop.set()
        watcher.join(timeout=10)
    text = httpx.get(gw.url + "/metrics", timeout=5).text
    for emu in emus:
        name = _name(emu)
        assert seen_throughput.get(emu.url, 0) > 0, f"no throughput shown for {name}"
        assert _metric(text, "worker_spec_accept_length", name), name
        assert _metric(text, "worker_measured_accept_length", name), name
    for emu in emus[:2]:
        truth = _stats(emu)["totals"]["token_weighted_accept_length"]
        shown = _metric(text, "worker_spec_accept_length", _name(emu))
        assert truth and shown
        assert abs(shown - truth) <= 0.05 * truth, (shown, truth)


def test_a_vllm_worker_is_held_at_its_own_max_num_seqs(procs: ProcessManager) -> None:
    emu = _vllm(procs, "vllm", "--max-num-seqs", "2", "--vllm-dev-mode")
    gw = gateway(procs, [emu], env={"DFLASH_GATEWAY_ADMISSION__QUEUE_TIMEOUT_S": "60"})
    assert _workers(gw)[emu.url]["capacity"]["admission_cap"] == 2
    _gate(emu, {"hold_after_chunks": 1})
    results: list[int] = []

    def stream(i: int) -> None:
        with httpx.stream("POST", gw.url + CHAT, json=_body(i), timeout=60) as response:
            response.read()
            results.append(response.status_code)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(5)]
    for thread in threads:
        thread.start()
    try:
        poll(lambda: len(httpx.get(emu.url + "/emulator/stats", timeout=5).json()["active"]) == 2)
        poll(lambda: httpx.get(gw.url + "/workers", timeout=5).json()["queued"] == 3)
        assert len(httpx.get(emu.url + "/emulator/stats", timeout=5).json()["active"]) == 2
    finally:
        _gate(emu, {"release": True})
        for thread in threads:
            thread.join(timeout=60)
    assert results == [200] * 5


def test_without_a_reported_max_num_seqs_the_setting_caps_a_pinned_vllm_worker(
    procs: ProcessManager,
) -> None:
    """A vLLM worker without dev mode reports no max_num_seqs: workers.vllm_max_num_seqs is its
    capacity. Its URL names its engine, which wins over workers.engine."""
    emu = _vllm(procs, "vllm")
    pinned = "vllm+" + emu.url
    env = {
        "DFLASH_GATEWAY_WORKERS__VLLM_MAX_NUM_SEQS": "3",
        "DFLASH_GATEWAY_WORKERS__ENGINE": "sglang",
    }
    gw = gateway(procs, [pinned], env=env)
    row = _workers(gw)[emu.url]
    assert row["engine"] == "vllm"
    assert row["capacity"]["admission_cap"] == 3


def test_a_killed_vllm_worker_fails_over_without_failing_requests(procs: ProcessManager) -> None:
    emus = [_vllm(procs, "vllm-a"), _vllm(procs, "vllm-b"), emulator(procs, "sglang")]
    gw = gateway(procs, emus, env={"DFLASH_GATEWAY_HEALTH__FAILURE_THRESHOLD": "2"})
    poll(lambda: all(w["state"] == "healthy" for w in _workers(gw).values()), timeout=15)
    victim = emus[0]
    victim.kill()
    statuses = [httpx.post(gw.url + CHAT, json=_body(i), timeout=30).status_code for i in range(9)]
    assert statuses == [200] * 9
    poll(lambda: _workers(gw)[victim.url]["state"] == "unhealthy", timeout=10)


def test_a_client_leaving_aborts_on_a_vllm_worker_by_closing_the_connection(
    procs: ProcessManager,
) -> None:
    emu = _vllm(procs, "vllm")
    gw = gateway(procs, [emu])
    _gate(emu, {"hold_after_chunks": 2})
    client = httpx.Client(timeout=30)
    with client.stream("POST", gw.url + CHAT, json=_body(1)) as response:
        lines = response.iter_lines()
        while not next(lines).startswith("data: "):
            pass
    client.close()
    poll(lambda: _stats(emu)["totals"]["disconnects"] == 1, timeout=10)
    _gate(emu, {"release": True})
    text = httpx.get(gw.url + "/metrics", timeout=5).text
    # No /abort_request call (vLLM has none): the closed connection was the abort.
    assert re.search(r"^dflash_gateway_aborts_sent_total 0\.0$", text, re.M), text
    poll(lambda: _workers(gw)[emu.url]["in_flight"] == 0)


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


def test_vllm_tool_call_chunks_reach_openai_and_anthropic_clients(procs: ProcessManager) -> None:
    """vLLM's tool-call deltas (id, type and name on the first only) assemble in the OpenAI SDK
    and become an Anthropic tool_use block; the worker is pinned by its URL."""
    emu = _vllm(procs, "vllm")
    gw = gateway(procs, ["vllm+" + emu.url])
    assert _workers(gw)[emu.url]["engine"] == "vllm"
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0)
    stream = client.chat.completions.create(
        model="kimi-k2.5",
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=[WEATHER],  # type: ignore[list-item]
        tool_choice="required",
        stream=True,
        extra_body={"chat_template_kwargs": {"thinking": False}},
    )
    calls: dict[int, dict[str, str]] = {}
    finish = None
    for chunk in stream:
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for call in choice.delta.tool_calls or ():
                seen = calls.setdefault(call.index, {"id": "", "name": "", "arguments": ""})
                seen["id"] += call.id or ""
                if call.function is not None:
                    seen["name"] += call.function.name or ""
                    seen["arguments"] += call.function.arguments or ""
    assert finish == "tool_calls"
    [call] = calls.values()
    assert call["name"] == "get_weather" and call["id"]
    assert "city" in call["arguments"]
    claude = anthropic.Anthropic(base_url=gw.url, api_key="unused", max_retries=0)
    with claude.messages.stream(
        model="kimi-k2.5",
        max_tokens=4000,
        tools=[{"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}],  # type: ignore[index, list-item]
        tool_choice={"type": "any"},
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
    ) as events:
        final = events.get_final_message()
    [use] = [block for block in final.content if block.type == "tool_use"]
    assert use.name == "get_weather" and "city" in use.input  # type: ignore[operator]
    assert final.stop_reason == "tool_use"


def test_a_vllm_error_reaches_the_client_in_openai_shape_with_its_message(
    procs: ProcessManager,
) -> None:
    """vLLM nests its error under ``error``; the client gets OpenAI's shape with the message."""
    emu = _vllm(procs, "vllm")
    gw = gateway(procs, [emu])
    httpx.post(emu.url + "/emulator/faults", json={"fail_status": 400}, timeout=5)
    direct = httpx.post(emu.url + CHAT, json=_body(1, stream=False), timeout=10).json()
    assert direct["error"]["message"] == "Injected failure."
    response = httpx.post(gw.url + CHAT, json=_body(1, stream=False), timeout=10)
    assert response.status_code == 400
    assert response.json()["error"]["message"] == "Injected failure."


def test_vllm_reasoning_becomes_responses_reasoning_items(procs: ProcessManager) -> None:
    """The Responses API turns vLLM's ``reasoning`` into a reasoning item, whole and streamed."""
    emu = _vllm(procs, "vllm")
    gw = gateway(procs, [emu])
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0)
    out = client.responses.create(
        model="kimi-k2.5", input="What is the capital of France?", max_output_tokens=4000
    )
    assert [item.type for item in out.output] == ["reasoning", "message"]
    kinds = [
        event.type
        for event in client.responses.create(
            model="kimi-k2.5",
            input="What is the capital of France?",
            max_output_tokens=4000,
            reasoning={"effort": "high", "summary": "auto"},
            stream=True,
        )
    ]
    assert "response.reasoning_summary_text.delta" in kinds
    assert kinds[-1] == "response.completed"
