"""Operational endpoints and request options on a running emulator."""

from __future__ import annotations

import httpx

from tests.emulator.support import CHAT, stream_events
from tests.support.procs import ManagedProcess

TOOL = {
    "type": "function",
    "function": {"name": "search", "parameters": {"type": "object", "properties": {}}},
}


def test_server_and_model_info(emu: ManagedProcess) -> None:
    with httpx.Client(base_url=emu.url, timeout=30) as client:
        client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 30})
        info = client.get("/server_info").json()
        assert client.get("/get_server_info").json()["speculative_algorithm"] == "DFLASH"
        model = client.get("/model_info").json()
        assert client.get("/get_model_info").json() == model
    assert info["speculative_num_draft_tokens"] == 8
    assert info["max_running_requests"] == 48
    assert info["internal_states"][0]["avg_spec_accept_length"] > 1
    assert model["model_path"] == "moonshotai/Kimi-K2.5" and model["is_generation"] is True


def test_loads_sections(emu: ManagedProcess) -> None:
    with httpx.Client(base_url=emu.url, timeout=30) as client:
        client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 30})
        both = client.get("/v1/loads", params={"include": "core,spec"}).json()
        core = client.get("/v1/loads", params={"include": "core"}).json()
        bad = client.get("/v1/loads", params={"include": "nope"})
    load = both["loads"][0]
    assert load["max_running_requests"] == 48 and load["num_running_reqs"] == 0
    assert load["speculative"]["accept_length"] > 1
    assert 0 < load["speculative"]["accept_rate"] < 1
    assert "speculative" not in core["loads"][0]
    assert bad.status_code == 400 and bad.json()["code"] == 400


def test_max_completion_tokens_and_matched_stop(emu: ManagedProcess) -> None:
    with httpx.Client(base_url=emu.url, timeout=30) as client:
        capped = client.post(
            "/v1/chat/completions", json={**CHAT, "max_completion_tokens": 7, "max_tokens": 99}
        ).json()
        natural = stream_events(client, "/v1/chat/completions", CHAT)
    assert capped["usage"]["completion_tokens"] == 7
    finish = natural[-2]["choices"][0]
    assert finish["finish_reason"] == "stop" and finish["matched_stop"] == 163586


def test_tool_choice_none_and_auto(emu: ManagedProcess) -> None:
    ask = {"messages": [{"role": "user", "content": "please search the web"}], "tools": [TOOL]}
    with httpx.Client(base_url=emu.url, timeout=30) as client:
        auto = client.post("/v1/chat/completions", json=ask).json()
        none = client.post("/v1/chat/completions", json={**ask, "tool_choice": "none"}).json()
        unrelated = client.post("/v1/chat/completions", json={**CHAT, "tools": [TOOL]}).json()
    assert auto["choices"][0]["finish_reason"] == "tool_calls"
    assert auto["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"] == "{}"
    assert none["choices"][0]["finish_reason"] == "stop"
    assert "tool_calls" not in none["choices"][0]["message"]
    assert unrelated["choices"][0]["finish_reason"] == "stop"


def test_unknown_route_and_method(emu: ManagedProcess) -> None:
    with httpx.Client(base_url=emu.url, timeout=30) as client:
        missing = client.get("/v1/nothing")
        assert missing.status_code == 404 and missing.json() == {"detail": "Not Found"}
        assert client.get("/v1/chat/completions").status_code == 405


def test_ready_and_model_card(emu: ManagedProcess) -> None:
    with httpx.Client(base_url=emu.url, timeout=30) as client:
        assert client.get("/ready").status_code == 200
        card = client.get("/v1/models/moonshotai/Kimi-K2.5")
        missing = client.get("/v1/models/other")
    assert card.json()["id"] == "moonshotai/Kimi-K2.5" and card.json()["owned_by"] == "sglang"
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
