"""``continue_final_message`` and ``/v1/tokenize`` on the emulated worker: a continued prefix goes
on exactly where the unbroken answer would have, counted as prompt by the tokens that made it, and
``/v1/tokenize`` counts a chat request's prompt as its answer reports it."""

from __future__ import annotations

from typing import Any

import httpx
import orjson
import pytest

from tests.support.procs import ManagedProcess

pytestmark = pytest.mark.processes

MODEL = "moonshotai/Kimi-K2.5"
MESSAGES = [{"role": "user", "content": "Explain how a bicycle stays upright."}]


def stream(
    emu: ManagedProcess, body: dict[str, Any]
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The text chunks (reasoning, content) of a chat stream and its usage."""
    payload = {"model": MODEL, "seed": 5, "stream": True, **body}
    payload["stream_options"] = {"include_usage": True}
    text = httpx.post(emu.url + "/v1/chat/completions", json=payload, timeout=60).text
    docs = [orjson.loads(ln[6:]) for ln in text.splitlines() if ln.startswith("data: {")]
    deltas = [c["delta"] for d in docs for c in d["choices"]]
    chunks = [d for d in deltas if d.get("reasoning_content") or d.get("content")]
    return chunks, docs[-1]["usage"]


def prefix_of(chunks: list[dict[str, Any]]) -> str:
    reasoning = "".join(c.get("reasoning_content") or "" for c in chunks)
    content = "".join(c.get("content") or "" for c in chunks)
    return "<think>" + reasoning + ("</think>" + content if content else "")


def tokenize(emu: ManagedProcess, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(
        emu.url + "/v1/tokenize", json={"model": MODEL, "seed": 5, **body}, timeout=10
    )


@pytest.mark.parametrize("where", ["reasoning", "answer"])
def test_a_continued_prefix_goes_on_where_the_answer_would_have(
    emu: ManagedProcess, where: str
) -> None:
    asked = 3000
    whole, usage = stream(emu, {"messages": MESSAGES, "max_tokens": asked})
    answer = next(i for i, c in enumerate(whole) if c.get("content"))
    cut = 5 if where == "reasoning" else answer + 3
    assert len(whole) > cut
    prefix = prefix_of(whole[:cut])
    continued = {
        "messages": [*MESSAGES, {"role": "assistant", "content": prefix}],
        "continue_final_message": True,
    }
    streamed = (
        tokenize(emu, continued).json()["count"]
        - tokenize(emu, {"messages": MESSAGES}).json()["count"]
    )
    rest, more = stream(emu, {**continued, "max_tokens": asked - streamed})
    assert [*whole[:cut], *rest] == whole
    assert len(rest) == len(whole) - cut  # the same chunks: the same verify steps
    # The prefix is prompt, counted as the tokens that produced it: over both attempts, the
    # completion tokens are the unbroken answer's.
    assert more["prompt_tokens"] == usage["prompt_tokens"] + streamed
    assert streamed + more["completion_tokens"] == usage["completion_tokens"]


def test_a_prefix_with_its_reasoning_closed_counts_the_reasoning_tokens(
    emu: ManagedProcess,
) -> None:
    """``<think>`` reasoning ``</think>`` with no answer yet: the tokens through the </think>,
    the reasoning tokens the unbroken answer reports (how a gateway counts the reasoning of an
    attempt that broke after the answer began)."""
    for seed in range(1, 9):  # where the </think> falls in its verify step varies
        whole, usage = stream(emu, {"messages": MESSAGES, "max_tokens": 3000, "seed": seed})
        reasoning = "".join(c.get("reasoning_content") or "" for c in whole)
        closed = {"role": "assistant", "content": "<think>" + reasoning + "</think>"}
        messages = [*MESSAGES, closed]
        count = tokenize(emu, {"messages": messages, "continue_final_message": True, "seed": seed})
        plain = tokenize(emu, {"messages": MESSAGES, "seed": seed}).json()["count"]
        assert usage["reasoning_tokens"] > 0
        assert count.json()["count"] - plain == usage["reasoning_tokens"], seed


def test_tokenize_counts_a_chat_prompt_as_its_answer_reports_it(emu: ManagedProcess) -> None:
    _, usage = stream(emu, {"messages": MESSAGES, "max_tokens": 8})
    answer = tokenize(emu, {"messages": MESSAGES})
    assert answer.status_code == 200
    doc = answer.json()
    assert doc["count"] == usage["prompt_tokens"] == len(doc["tokens"])
    assert tokenize(emu, {"prompt": "x" * 41}).json()["count"] == 11  # 4 characters a token
    assert tokenize(emu, {}).status_code == 400  # neither prompt nor messages
    assert tokenize(emu, {"prompt": "a", "messages": MESSAGES}).status_code == 400
