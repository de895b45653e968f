"""Streams that survive their worker (``app.proxy.continuation``), with real processes: three
emulated workers, two of which drop every stream's connection after some events, and a gateway
in front of them. Whatever worker a stream starts on, its client (curl-like httpx, the openai
SDK, the anthropic SDK, the Responses API through the openai SDK) sees one ordinary stream with
exactly the text the worker would have produced; with every worker failing, the in-band error as
before.
"""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import orjson
import pytest

from tests.e2e.conftest import Stack, emulator, gateway, poll
from tests.support.procs import ManagedProcess, ProcessManager
from tests.support.tools import require_tool

pytestmark = pytest.mark.processes

MODEL = "moonshotai/Kimi-K2.5"
CHAT = "/v1/chat/completions"
KEY = "sk-continuation-e2e-0123456789"
OFF_KEY = "sk-continuation-off-012345678"
PROMPT = "Explain how a bicycle stays upright."


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    manager = ProcessManager(Path(tmp_path_factory.mktemp("continuation")))
    env = {
        "DFLASH_GATEWAY_API_KEYS": f"main:{KEY},off:{OFF_KEY}",
        "DFLASH_GATEWAY_POLICY": "round_robin",
        "DFLASH_GATEWAY_TENANTS__KEYS": '{"off": {"continue_streams": false}}',
        # Workers that drop streams on purpose stay in the pool from test to test.
        "DFLASH_GATEWAY_BREAKER__FAILURE_THRESHOLD": "1000",
    }
    try:
        emus = [emulator(manager, f"emu-{n}", "--seed", "1") for n in "abc"]
        yield Stack(gateway(manager, emus, env=env), emus)
    except BaseException:
        for chunk in manager.dump_logs():
            print(chunk)
        raise
    finally:
        manager.stop_all()


@pytest.fixture
def fresh(stack: Stack) -> Iterator[Stack]:
    stack.reset()
    yield stack
    stack.reset()


def body(**extra: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": PROMPT}],
        "seed": 11,
        "stream": True,
        **extra,
    }


def events_of(text: str) -> list[str]:
    return [line[5:].strip() for line in text.splitlines() if line.startswith("data:")]


def chunks_of(events: list[str]) -> list[dict[str, Any]]:
    return [orjson.loads(e) for e in events if e != "[DONE]"]


def texts(chunks: list[dict[str, Any]]) -> tuple[str, str, int]:
    """The reasoning, the answer and the number of chunks that carried either."""
    reasoning, content, steps = [], [], 0
    for chunk in chunks:
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            r, c = delta.get("reasoning_content"), delta.get("content")
            reasoning.append(r or "")
            content.append(c or "")
            steps += bool(r or c)
    return "".join(reasoning), "".join(content), steps


def reference(stack: Stack, **extra: Any) -> tuple[str, str, int]:
    """What a worker produces for the request, uninterrupted (straight from a healthy one)."""
    response = httpx.post(stack.emus[2].url + CHAT, json=body(**extra), timeout=60)
    return texts(chunks_of(events_of(response.text)))


def continuations(stack: Stack, outcome: str) -> float:
    text = httpx.get(
        stack.gw.url + "/metrics", headers={"authorization": f"Bearer {KEY}"}, timeout=5
    ).text
    match = re.search(
        r'^dflash_gateway_stream_continuations_total\{outcome="' + outcome + r'"\} (\S+)$',
        text,
        re.MULTILINE,
    )
    assert match, f"no continuations series for {outcome}"
    return float(match.group(1))


def break_two(stack: Stack, after: int = 25) -> None:
    """Workers a and b drop every stream's connection after ``after`` events; c is healthy."""
    for emu in stack.emus[:2]:
        stack.control(emu, "/emulator/faults", {"die_after_chunks": after})


def post(gw: ManagedProcess, payload: dict[str, Any], key: str = KEY) -> httpx.Response:
    return httpx.post(
        gw.url + CHAT, json=payload, headers={"authorization": f"Bearer {key}"}, timeout=60
    )


def test_a_broken_stream_goes_on_with_exactly_the_text_it_would_have_had(fresh: Stack) -> None:
    want = reference(fresh)
    break_two(fresh)
    before = continuations(fresh, "ok")
    for _ in range(4):  # round robin: streams start on every worker, broken or not
        response = post(fresh.gw, body(stream_options={"include_usage": True}))
        assert response.status_code == 200
        events = events_of(response.text)
        assert events.count("[DONE]") == 1 and events[-1] == "[DONE]"
        chunks = chunks_of(events)
        assert not [c for c in chunks if "error" in c], response.text[-500:]
        assert len({c["id"] for c in chunks}) == 1  # one id, the first attempt's
        roles = [c for c in chunks for ch in c["choices"] if ch["delta"].get("role")]
        assert len(roles) == 1 and chunks[0] is roles[0]
        finishes = [ch["finish_reason"] for c in chunks for ch in c["choices"]]
        assert [f for f in finishes if f] == ["stop"]
        assert texts(chunks) == want  # no text repeated or missing, chunk for chunk
        usage = chunks[-1]["usage"]
        assert usage["completion_tokens"] > 0 and usage["prompt_tokens"] > 0
    assert continuations(fresh, "ok") > before


def test_the_openai_sdk_sees_one_ordinary_stream(fresh: Stack) -> None:
    want = reference(fresh)
    break_two(fresh, after=40)
    with openai.OpenAI(base_url=fresh.gw.url + "/v1", api_key=KEY, max_retries=0) as client:
        for _ in range(3):
            stream = client.chat.completions.create(**body())
            chunks = list(stream)
            assert len({c.id for c in chunks}) == 1
            reasoning = "".join(
                getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks
            )
            content = "".join(c.choices[0].delta.content or "" for c in chunks)
            assert (reasoning, content) == want[:2]


def test_anthropic_and_responses_clients_see_one_stream(fresh: Stack) -> None:
    prompt = [{"role": "user", "content": PROMPT}]
    with anthropic.Anthropic(base_url=fresh.gw.url, api_key=KEY, max_retries=0) as client:

        def message() -> tuple[str, str, list[str], int]:
            with client.messages.stream(
                model=MODEL,
                max_tokens=4000,
                messages=prompt,  # type: ignore[arg-type]
                extra_body={"seed": 11},
            ) as stream:
                kinds = [e.type for e in stream]
                final = stream.get_final_message()
            thinking = "".join(b.thinking for b in final.content if b.type == "thinking")
            text = "".join(b.text for b in final.content if b.type == "text")
            assert final.stop_reason == "end_turn"
            return thinking, text, kinds, final.usage.output_tokens

        want = message()  # uninterrupted: every worker healthy
        break_two(fresh, after=12)
        for _ in range(3):
            got = message()
            assert got[:2] == want[:2]
            assert got[2].count("message_start") == 1 and got[2].count("message_stop") == 1
            assert got[2] == want[2]  # the same events: nothing repeated or missing
            assert got[3] == want[3]  # every token streamed, by either worker, counted once

    fresh.reset()
    with openai.OpenAI(base_url=fresh.gw.url + "/v1", api_key=KEY, max_retries=0) as oai:

        def response() -> tuple[str, list[str], int]:
            with oai.responses.stream(
                model=MODEL, input=PROMPT, max_output_tokens=4000, extra_body={"seed": 11}
            ) as rstream:
                kinds = [e.type for e in rstream]
                done = rstream.get_final_response()
            assert done.status == "completed" and done.usage is not None
            return done.output_text, kinds, done.usage.output_tokens

        rwant = response()
        break_two(fresh, after=12)
        for _ in range(3):
            text, kinds, tokens = response()
            assert text == rwant[0] and tokens == rwant[2]
            assert kinds.count("response.created") == 1
            assert kinds.count("response.completed") == 1
            assert kinds == rwant[1]


def test_with_every_worker_failing_the_stream_ends_with_an_in_band_error(fresh: Stack) -> None:
    for emu in fresh.emus:
        fresh.control(emu, "/emulator/faults", {"die_after_chunks": 6})
    response = post(fresh.gw, body())
    events = events_of(response.text)
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    assert orjson.loads(events[-2])["error"]["code"] == "stream_interrupted"
    chunks = chunks_of(events[:-2])
    assert len({c["id"] for c in chunks}) == 1
    # Six events from the first worker, five more (no second role chunk) from each of the two
    # continuations (retry.mid_stream_attempts = 2), then the error.
    assert len(chunks) == 6 + 5 + 5


def test_a_key_that_turned_continuations_off_gets_the_in_band_error(fresh: Stack) -> None:
    for emu in fresh.emus:
        fresh.control(emu, "/emulator/faults", {"die_after_chunks": 6})
    events = events_of(post(fresh.gw, body(), key=OFF_KEY).text)
    assert events[-1] == "[DONE]"
    assert orjson.loads(events[-2])["error"]["code"] == "stream_interrupted"
    assert len(events) == 6 + 2


def test_a_workers_in_band_error_is_continued_from_too(fresh: Stack) -> None:
    want = reference(fresh)
    for emu in fresh.emus[:2]:
        fresh.control(emu, "/emulator/faults", {"inband_error_after_chunks": 9})
    for _ in range(3):
        events = events_of(post(fresh.gw, body()).text)
        assert events.count("[DONE]") == 1
        chunks = chunks_of(events)
        assert not [c for c in chunks if "error" in c]
        assert len({c["id"] for c in chunks}) == 1
        assert texts(chunks) == want


def test_curl_sees_one_stream(fresh: Stack) -> None:
    curl = require_tool("curl")
    want = reference(fresh)
    break_two(fresh, after=30)
    for _ in range(3):
        cmd = [curl, "-sN", fresh.gw.url + CHAT, "-H", f"authorization: Bearer {KEY}"]
        cmd += ["-H", "content-type: application/json", "-d", json.dumps(body())]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=True).stdout
        events = events_of(out)
        assert events.count("[DONE]") == 1 and events[-1] == "[DONE]"
        chunks = chunks_of(events)
        assert len({c["id"] for c in chunks}) == 1
        assert texts(chunks) == want


def test_a_stream_is_not_continued_on_a_vllm_worker(tmp_path: Path) -> None:
    """Continuations follow SGLang's continue_final_message: with only a vLLM worker left, the
    broken stream ends with the in-band error (counted as no_worker)."""
    manager = ProcessManager(tmp_path)
    env = {"DFLASH_GATEWAY_POLICY": "round_robin"}
    try:
        sglang = emulator(manager, "emu-sglang", "--seed", "1")
        vllm = emulator(manager, "emu-vllm", "--seed", "1", "--engine", "vllm")
        gw = gateway(manager, [sglang, vllm], env=env)
        Stack(gw, [sglang]).control(sglang, "/emulator/faults", {"die_after_chunks": 6})
        ends = []
        for _ in range(2):  # round robin: one starts on each
            events = events_of(httpx.post(gw.url + CHAT, json=body(), timeout=60).text)
            assert events[-1] == "[DONE]"
            ends.append(orjson.loads(events[-2]).get("error", {}).get("code"))
        assert sorted(ends, key=str) == [None, "stream_interrupted"]
        metrics = httpx.get(gw.url + "/metrics", timeout=5).text
        assert 'dflash_gateway_stream_continuations_total{outcome="no_worker"} 1.0' in metrics
    except BaseException:
        for chunk in manager.dump_logs():
            print(chunk)
        raise
    finally:
        manager.stop_all()


def worker_counts(stack: Stack, name: str) -> dict[str, float]:
    """The gateway's token and verify-step counters of one worker, by metric."""
    text = httpx.get(
        stack.gw.url + "/metrics", headers={"authorization": f"Bearer {KEY}"}, timeout=5
    ).text
    out: dict[str, float] = {}
    for metric in ("prompt_tokens", "completion_tokens", "spec_verify_steps"):
        pattern = (
            rf'^dflash_gateway_{metric}_total\{{[^}}]*worker="{re.escape(name)}"[^}}]*\}} (\S+)$'
        )
        out[metric] = sum(float(m) for m in re.findall(pattern, text, re.MULTILINE))
    return out


def test_usage_covers_every_attempt_as_the_workers_counted_it(fresh: Stack) -> None:
    """The client's usage (what its key is charged) is the sum of what the workers themselves
    recorded for the request (their stats: every prefill, every token generated), the completion
    tokens those of the unbroken stream; each worker's counters at the gateway grow by its own
    attempt's tokens."""
    unbroken = post(fresh.gw, body(stream_options={"include_usage": True}))
    want = chunks_of(events_of(unbroken.text))[-1]["usage"]
    break_two(fresh, after=25)
    table = httpx.get(fresh.gw.url + "/workers", headers={"authorization": f"Bearer {KEY}"})
    names = {w["url"]: w["name"] for w in table.json()["workers"]}
    continued = n = 0
    while continued < 2 and n < 8:  # round robin: most start on a breaking worker
        n += 1
        request_id = f"continued-usage-{n}"
        before = {emu.url: worker_counts(fresh, names[emu.url]) for emu in fresh.emus}
        response = httpx.post(
            fresh.gw.url + CHAT,
            json=body(stream_options={"include_usage": True}),
            headers={"authorization": f"Bearer {KEY}", "x-request-id": request_id},
            timeout=60,
        )
        request_id = response.headers["x-request-id"]  # the gateway's own: the workers get it
        usage = chunks_of(events_of(response.text))[-1]["usage"]
        records = {
            emu.url: [r for r in fresh.stats(emu)["requests"] if r["request_id"] == request_id]
            for emu in fresh.emus
        }
        attempts = [r for rs in records.values() for r in rs]
        continued += len(attempts) > 1
        assert usage["prompt_tokens"] == sum(r["prompt_tokens"] for r in attempts)
        assert usage["completion_tokens"] == sum(r["completion_tokens"] for r in attempts)
        assert usage["completion_tokens"] == want["completion_tokens"]
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        for emu in fresh.emus:
            after = worker_counts(fresh, names[emu.url])
            own = records[emu.url]
            grew = {k: after[k] - before[emu.url][k] for k in after}
            assert grew["prompt_tokens"] == sum(r["prompt_tokens"] for r in own)
            assert grew["completion_tokens"] == sum(r["completion_tokens"] for r in own)
            assert (grew["spec_verify_steps"] > 0) == bool(own)
    assert continued == 2


def access_record(gw: ManagedProcess, request_id: str) -> dict[str, str]:
    """The gateway's access-log fields for ``request_id`` (its ``key=value`` line)."""

    def line() -> str | None:
        return next(
            (ln for ln in gw.logs().splitlines() if f"request_id={request_id} " in ln), None
        )

    found = poll(line)
    return dict(re.findall(r"(\w+)=(\S+)", found))


def test_reasoning_tokens_cover_every_attempt_of_a_stream_broken_while_thinking(
    fresh: Stack,
) -> None:
    """A stream broken in its reasoning part (after 25 events: the emulator thinks for at least
    200 tokens) and continued tells its client the reasoning tokens of the unbroken stream, on
    the chat completions usage chunk and on the Responses API's usage, and the workers' own
    reasoning tokens add up to them."""
    unbroken = post(fresh.gw, body(stream_options={"include_usage": True}))
    want = chunks_of(events_of(unbroken.text))[-1]["usage"]
    assert want["reasoning_tokens"] > 25
    with openai.OpenAI(base_url=fresh.gw.url + "/v1", api_key=KEY, max_retries=0) as oai:

        def response() -> tuple[int, int]:
            with oai.responses.stream(
                model=MODEL, input=PROMPT, max_output_tokens=4000, extra_body={"seed": 11}
            ) as rstream:
                done = rstream.get_final_response()
            assert done.status == "completed" and done.usage is not None
            return done.usage.output_tokens, done.usage.output_tokens_details.reasoning_tokens

        rwant = response()
        assert rwant[1] > 25
        break_two(fresh, after=25)
        continued = n = 0
        while continued < 2 and n < 8:  # round robin: most start on a breaking worker
            n += 1
            request_id = f"continued-reasoning-{n}"
            response_ = httpx.post(
                fresh.gw.url + CHAT,
                json=body(stream_options={"include_usage": True}),
                headers={"authorization": f"Bearer {KEY}", "x-request-id": request_id},
                timeout=60,
            )
            request_id = response_.headers["x-request-id"]  # the gateway's own: the workers get it
            usage = chunks_of(events_of(response_.text))[-1]["usage"]
            attempts = [
                r
                for emu in fresh.emus
                for r in fresh.stats(emu)["requests"]
                if r["request_id"] == request_id
            ]
            continued += len(attempts) > 1
            assert usage["reasoning_tokens"] == want["reasoning_tokens"]
            assert usage["completion_tokens_details"] == want["completion_tokens_details"]
            assert usage["reasoning_tokens"] == sum(r["reasoning_tokens"] for r in attempts)
            record = access_record(fresh.gw, request_id)
            assert int(record["reasoning_tokens"]) == want["reasoning_tokens"]
        assert continued == 2
        for _ in range(3):
            assert response() == rwant


def test_reasoning_tokens_of_a_stream_broken_after_its_answer_began(fresh: Stack) -> None:
    """Broken a few events into the answer: the attempt that broke streamed the reasoning and
    the start of the answer, the continuation only answer; the client is told the unbroken
    stream's reasoning tokens (the broken attempt's counted up to its </think> by a worker)."""
    unbroken = post(fresh.gw, body(stream_options={"include_usage": True}))
    chunks = chunks_of(events_of(unbroken.text))
    want = chunks[-1]["usage"]
    thinking = sum(1 for c in chunks for ch in c["choices"] if ch["delta"].get("reasoning_content"))
    break_two(fresh, after=thinking + 4)  # the role chunk, the reasoning, three answer chunks
    continued = n = 0
    while continued < 2 and n < 8:
        n += 1
        request_id = f"continued-answer-{n}"
        response = httpx.post(
            fresh.gw.url + CHAT,
            json=body(stream_options={"include_usage": True}),
            headers={"authorization": f"Bearer {KEY}", "x-request-id": request_id},
            timeout=60,
        )
        request_id = response.headers["x-request-id"]  # the gateway's own: the workers get it
        got = chunks_of(events_of(response.text))
        attempts = [
            r
            for emu in fresh.emus
            for r in fresh.stats(emu)["requests"]
            if r["request_id"] == request_id
        ]
        continued += len(attempts) > 1
        assert texts(got)[:2] == texts(chunks)[:2]
        usage = got[-1]["usage"]
        assert usage["completion_tokens"] == want["completion_tokens"]
        assert usage["reasoning_tokens"] == want["reasoning_tokens"]
        assert usage["completion_tokens_details"] == want["completion_tokens_details"]
    assert continued == 2


def test_a_continuation_ends_where_the_unbroken_stream_would_at_max_tokens(fresh: Stack) -> None:
    """The continuation's max_tokens is what was asked less the tokens streamed, counted by the
    worker (not estimated): a stream cut by max_tokens ends at the same token either way."""
    want = reference(fresh, max_tokens=90)
    break_two(fresh, after=20)
    for _ in range(3):
        chunks = chunks_of(events_of(post(fresh.gw, body(max_tokens=90)).text))
        assert texts(chunks) == want
        finishes = [ch["finish_reason"] for c in chunks for ch in c["choices"]]
        assert [f for f in finishes if f] == ["length"]
