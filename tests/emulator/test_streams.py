"""Chat and text-completion streams and bodies: SGLang's chunk sequence, ids, usage."""

from __future__ import annotations

import httpx

from tests.emulator.support import CHAT, record, stream_events
from tests.support.procs import ManagedProcess


def test_chat_stream_sequence_and_rid(emu: ManagedProcess) -> None:
    with httpx.Client(base_url=emu.url, timeout=30) as client:
        body = {
            **CHAT,
            "rid": "rid-stream-1",
            "max_tokens": 400,
            "stream_options": {"include_usage": True},
        }
        evs = stream_events(client, "/v1/chat/completions", body)
        rec = record(client, "rid-stream-1")
    assert evs[-1] == "[DONE]"
    chunks = evs[:-1]
    assert all(c["id"] == "rid-stream-1" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {
        "reasoning_content": None,
        "role": "assistant",
        "content": "",
    }
    usage_chunk, finish_chunk = chunks[-1], chunks[-2]
    assert usage_chunk["choices"] == []
    assert finish_chunk["choices"][0]["finish_reason"] in ("stop", "length")
    body_chunks = chunks[1:-2]
    kinds = ["r" if "content" not in c["choices"][0]["delta"] else "c" for c in body_chunks]
    assert kinds[0] == "r", "thinking output starts with reasoning_content"
    assert "".join(kinds) == "r" * kinds.count("r") + "c" * kinds.count("c")
    usage = usage_chunk["usage"]
    assert usage["completion_tokens"] == rec["completion_tokens"] == sum(rec["tokens_per_step"])
    assert usage["reasoning_tokens"] == rec["reasoning_tokens"] > 0
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert all(1 <= t <= 8 for t in rec["tokens_per_step"])
    # One chunk per verify step (a step of hidden tokens only, e.g. </think>, sends none).
    assert len(body_chunks) <= rec["steps"] + 1


def test_thinking_off_has_no_reasoning(emu: ManagedProcess) -> None:
    with httpx.Client(base_url=emu.url, timeout=30) as client:
        body = {**CHAT, "chat_template_kwargs": {"thinking": False}, "max_tokens": 50}
        evs = stream_events(client, "/v1/chat/completions", body)
        plain = client.post("/v1/chat/completions", json=body).json()
    deltas = [e["choices"][0]["delta"] for e in evs[1:-2]]
    assert deltas and all(d["reasoning_content"] is None and d["content"] for d in deltas)
    assert plain["choices"][0]["message"]["reasoning_content"] is None
    assert plain["usage"]["reasoning_tokens"] == 0


def test_non_stream_chat_body(emu: ManagedProcess) -> None:
    with httpx.Client(base_url=emu.url, timeout=30) as client:
        body = {**CHAT, "max_tokens": 64, "rid": "rid-ns-1", "return_meta_info": True}
        out = client.post("/v1/chat/completions", json=body).json()
    assert out["id"] == "rid-ns-1"
    assert out["object"] == "chat.completion"
    assert out["model"] == "default", "SGLang echoes the request's model, 'default' if unset"
    assert out["metadata"] == {"weight_version": "default"}
    choice = out["choices"][0]
    assert choice["finish_reason"] == "length"
    meta = choice["meta_info"]
    assert meta["completion_tokens"] == 64 == out["usage"]["completion_tokens"]
    assert meta["spec_accept_length"] == 64 / meta["spec_verify_ct"]
    assert meta["spec_num_proposed_drafts"] == 7 * meta["spec_verify_ct"]
    assert sum(meta["spec_accept_histogram"]) == meta["spec_verify_ct"]


def test_generated_id_is_uuid_hex(emu: ManagedProcess) -> None:
    with httpx.Client(base_url=emu.url, timeout=30) as client:
        body = {**CHAT, "max_tokens": 5, "model": "kimi"}
        out = client.post("/v1/chat/completions", json=body).json()
    assert len(out["id"]) == 32 and int(out["id"], 16) >= 0
    assert out["model"] == "kimi"


def test_completion_stream_last_chunk_carries_finish(emu: ManagedProcess) -> None:
    with httpx.Client(base_url=emu.url, timeout=30) as client:
        body = {"prompt": "Once upon a time", "max_tokens": 40, "rid": "rid-cmpl"}
        evs = stream_events(client, "/v1/completions", body)
        out = client.post("/v1/completions", json={**body, "rid": "rid-cmpl-2"}).json()
    chunks = evs[:-1]
    assert evs[-1] == "[DONE]"
    assert all(c["object"] == "text_completion" for c in chunks)
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    streamed = "".join(c["choices"][0]["text"] for c in chunks)
    assert out["choices"][0]["text"] == streamed, "greedy output is deterministic"
    assert out["usage"]["completion_tokens"] == 40


def test_same_prompt_and_seed_same_text(emu: ManagedProcess) -> None:
    body = {**CHAT, "max_tokens": 80, "temperature": 0.7, "seed": 3}
    with httpx.Client(base_url=emu.url, timeout=30) as client:
        a = client.post("/v1/chat/completions", json=body).json()
        b = client.post("/v1/chat/completions", json=body).json()
        c = client.post("/v1/chat/completions", json={**body, "seed": 4}).json()
    text = a["choices"][0]["message"]["reasoning_content"]
    assert text == b["choices"][0]["message"]["reasoning_content"]
    assert text != c["choices"][0]["message"]["reasoning_content"]
