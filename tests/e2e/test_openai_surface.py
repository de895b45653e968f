"""The OpenAI SDK against the embedded default (`dflash-gateway serve`, two emulated workers):
model retrieval, n > 1, logprobs, batched text completions, ``limits.max_n`` and a relayed worker
error, with the gateway's acceptance-length estimate held against the emulators' ground truth."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.e2e.conftest import poll
from tests.support.procs import PYTHON, ManagedProcess, managed_processes

MODEL = "moonshotai/Kimi-K2.5"
MESSAGES: list[Any] = [{"role": "user", "content": "Explain how tides work."}]


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ManagedProcess]:
    env = {
        "DFLASH_GATEWAY_EMBEDDED__BASE_PORT": "0",
        "DFLASH_GATEWAY_EMBEDDED__SPEED": "20",
        "DFLASH_GATEWAY_EXPOSE_ACCEPT_LENGTH": "true",
    }
    with managed_processes(tmp_path_factory, "surface") as manager:
        yield manager.start(
            [PYTHON, "-m", "app", "serve", "--port", "{port}"],
            name="serve",
            ready_path="/readyz",
            ready_status=200,
            timeout=60,
            env=env,
        )


@pytest.fixture
def client(gw: ManagedProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=gw.url + "/v1", api_key="none", max_retries=0) as sdk:
        yield sdk


def truth(gw: ManagedProcess, rids: set[str], *, request_id: str | None = None) -> list[Any]:
    """The emulators' records of these rids, or of ``count = len(rids)`` records sent with this
    X-Request-Id (waits until all are there), by choice index."""
    workers = [w["url"] for w in httpx.get(gw.url + "/workers", timeout=5).json()["workers"]]

    def wanted(record: dict[str, Any]) -> bool:
        if request_id is not None:
            return bool(record["request_id"] == request_id)
        return record["rid"] in rids

    def found() -> list[dict[str, Any]] | None:
        records = [
            r
            for url in workers
            for r in httpx.get(url + "/emulator/stats", timeout=5).json()["requests"]
            if wanted(r)
        ]
        return records if len(records) == len(rids) else None

    records: list[dict[str, Any]] = poll(found, timeout=10)
    return sorted(records, key=lambda r: r["index"])


def weighted(records: list[dict[str, Any]]) -> float:
    return sum(r["completion_tokens"] for r in records) / sum(r["steps"] for r in records)


def test_models_retrieve_by_alias_and_full_name(client: openai.OpenAI) -> None:
    alias = client.models.retrieve("kimi-k2.5")
    full = client.models.retrieve(MODEL)
    assert alias.id == "kimi-k2.5" and getattr(alias, "root", None) == MODEL
    assert full.id == MODEL and full.object == "model"
    assert {m.id for m in client.models.list().data} == {MODEL, "kimi-k2.5"}
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("gpt-9")
    assert info.value.code == "model_not_found"


def test_chat_n_with_logprobs(client: openai.OpenAI, gw: ManagedProcess) -> None:
    out = client.chat.completions.create(
        model="kimi-k2.5",
        messages=MESSAGES,
        n=3,
        temperature=0.7,
        max_tokens=60,
        logprobs=True,
        top_logprobs=3,
    )
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert out.usage is not None
    for choice in out.choices:
        assert choice.logprobs is not None and choice.logprobs.content
        for token in choice.logprobs.content:
            assert len(token.top_logprobs) == 3
            assert token.top_logprobs[0].logprob == token.logprob <= 0
    tokens = sum(len(c.logprobs.content) for c in out.choices if c.logprobs and c.logprobs.content)
    assert tokens == out.usage.completion_tokens  # every generated token is listed


def test_chat_stream_n_estimate_matches_ground_truth(
    client: openai.OpenAI, gw: ManagedProcess
) -> None:
    # Thinking on and max_tokens inside the reasoning: every verify step is one chunk, so the
    # estimate (data events - 2 per choice) must equal the emulator's token-weighted truth.
    stream = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        n=2,
        temperature=0.7,
        max_tokens=120,
        stream=True,
        stream_options={"include_usage": True},
    )
    ids: dict[int, set[str]] = defaultdict(set)
    text: dict[int, str] = defaultdict(str)
    usage = None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.finish_reason is None:
                ids[choice.index].add(chunk.id)
            text[choice.index] += getattr(choice.delta, "reasoning_content", None) or ""
    assert sorted(ids) == [0, 1] and all(len(v) == 1 for v in ids.values())
    assert all(text[i] for i in (0, 1))
    records = truth(gw, {next(iter(v)) for v in ids.values()})
    assert [r["index"] for r in records] == [0, 1]
    assert usage is not None
    assert usage.completion_tokens == sum(r["completion_tokens"] for r in records)
    estimated = (usage.model_extra or {})["spec_accept_length"]
    assert estimated == pytest.approx(weighted(records), abs=1e-3)


def test_chat_stream_n_estimate_tracks_truth_on_answers(
    client: openai.OpenAI, gw: ManagedProcess
) -> None:
    # Answers end with the stop token, whose step may carry no text (no chunk): the estimate is
    # then off by up to a step per choice; over several requests it stays within 5 %.
    estimates, truths = [], []
    for i in range(6):
        stream = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": f"Give me tip number {i} for a garden."}],
            n=3,
            temperature=0.7,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"chat_template_kwargs": {"thinking": False}},
        )
        ids: set[str] = set()
        usage = None
        for chunk in stream:
            usage = chunk.usage or usage
            ids.update(chunk.id for c in chunk.choices if c.finish_reason is None)
        assert usage is not None and len(ids) == 3
        estimates.append((usage.model_extra or {})["spec_accept_length"])
        truths.append(weighted(truth(gw, ids)))
    mean_estimate, mean_truth = sum(estimates) / 6, sum(truths) / 6
    assert mean_estimate == pytest.approx(mean_truth, rel=0.05)


def test_chat_n_exact_acceptance_header(gw: ManagedProcess) -> None:
    body = {"model": MODEL, "messages": MESSAGES, "n": 2, "max_tokens": 80, "temperature": 0.5}
    headers = {"X-Request-Id": "surface-exact-n2"}
    response = httpx.post(gw.url + "/v1/chat/completions", json=body, headers=headers, timeout=30)
    assert response.status_code == 200
    doc = response.json()
    assert all("meta_info" not in c for c in doc["choices"])  # the gateway's own field, taken
    # The workers get the gateway's own id (the client's is only logged).
    records = truth(gw, {"first", "second"}, request_id=response.headers["x-request-id"])
    assert [r["index"] for r in records] == [0, 1]
    assert doc["id"] == records[0]["rid"]  # the response carries the first choice's id
    assert doc["usage"]["completion_tokens"] == sum(r["completion_tokens"] for r in records)
    exact = float(response.headers["x-dflash-accept-length"])
    assert exact == pytest.approx(weighted(records), abs=1e-4)


@pytest.mark.parametrize("stream", [False, True])
def test_batched_completions_through_the_gateway(
    client: openai.OpenAI, gw: ManagedProcess, stream: bool
) -> None:
    prompts = ["The capital of France is", "def fibonacci(n):"]
    kwargs: dict[str, Any] = {"model": MODEL, "prompt": prompts, "n": 2, "max_tokens": 30}
    kwargs["logprobs"] = 2
    if not stream:
        out = client.completions.create(**kwargs)
        assert [c.index for c in out.choices] == [0, 1, 2, 3]
        for c in out.choices:
            assert c.logprobs is not None and c.logprobs.tokens
            assert c.logprobs.text_offset == [-1] * len(c.logprobs.tokens)
            assert all(len(top) == 2 for top in c.logprobs.top_logprobs or [])
        return
    seen: dict[int, set[str]] = defaultdict(set)
    usage = None
    events = client.completions.create(
        **kwargs, stream=True, stream_options={"include_usage": True}
    )
    for chunk in events:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            seen[choice.index].add(chunk.id)
            assert choice.logprobs is not None
    assert sorted(seen) == [0, 1, 2, 3]
    records = truth(gw, {rid for ids in seen.values() for rid in ids})
    assert [r["index"] for r in records] == [0, 1, 2, 3]
    assert usage is not None
    assert usage.completion_tokens == sum(r["completion_tokens"] for r in records)
    # text completions: one chunk per verify step and choice, the finish on the last one
    estimated = (usage.model_extra or {})["spec_accept_length"]
    assert estimated == pytest.approx(weighted(records), abs=1e-3)


def test_max_n_applies_to_n_and_batches(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, n=9)
    assert info.value.param == "n"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=["x"] * 9)
    assert info.value.param == "prompt"


@pytest.mark.parametrize("stream", [False, True])
def test_worker_400_reaches_the_sdk_as_bad_request(client: openai.OpenAI, stream: bool) -> None:
    huge = "word " * 220_000  # ~275k tokens by the worker's count: over the 262,144 context
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": huge}], stream=stream
        )
    error = info.value
    assert error.status_code == 400
    assert error.type == "invalid_request_error"
    assert error.code == "context_length_exceeded"
    assert error.param is None
    assert "longer than the model's context length (262144 tokens)" in error.message
    assert isinstance(error.body, dict) and set(error.body) == {"message", "type", "param", "code"}


def test_client_disconnect_ends_every_choice(gw: ManagedProcess) -> None:
    # SGLang gives parallel samples fresh rids, so the gateway's abort by rid cannot name them;
    # closing the worker connection (as the gateway does) must still end every choice.
    workers = [w["url"] for w in httpx.get(gw.url + "/workers", timeout=5).json()["workers"]]
    for url in workers:
        httpx.post(url + "/emulator/gate", json={"hold_after_chunks": 3}, timeout=5)
    body = {"model": MODEL, "messages": MESSAGES, "n": 2, "stream": True, "max_tokens": 4000}
    headers = {"X-Request-Id": "surface-disconnect-n2"}
    try:
        with httpx.Client(timeout=30) as client:
            url = gw.url + "/v1/chat/completions"
            with client.stream("POST", url, json=body, headers=headers) as response:
                request_id = response.headers["x-request-id"]  # the gateway's: the workers get it
                lines = response.iter_lines()
                while not next(lines).startswith("data: "):
                    pass
                poll(
                    lambda: any(
                        httpx.get(u + "/emulator/gate", timeout=5).json()["held"] for u in workers
                    )
                )
        records = truth(gw, {"first", "second"}, request_id=request_id)
    finally:
        for url in workers:
            httpx.post(url + "/emulator/gate", json={"release": True}, timeout=5)
    assert [r["index"] for r in records] == [0, 1]
    assert all(r["aborted"] in ("abort", "disconnect") for r in records)
    assert all(r["finish_reason"] == "abort" for r in records)

    def idle() -> bool:
        table = httpx.get(gw.url + "/workers", timeout=5).json()["workers"]
        return all(w["in_flight"] == 0 for w in table)

    poll(idle, timeout=5)
