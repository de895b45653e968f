"""Heterogeneous emulated workers: a running cap, a slower node (``--step-time-scale``) and a
mismatched drafter (``--accept-scale``), each visible where a gateway reads it."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from app.__main__ import build_parser
from app.emulator.cli import config_from_args
from tests.emulator.support import record
from tests.support.procs import PYTHON, ManagedProcess, ProcessManager

EMULATE = [PYTHON, "-m", "app", "emulate", "--port", "{port}", "--speed", "50", "--seed", "3"]


def _body(rid: str) -> dict[str, Any]:
    return {
        "model": "moonshotai/Kimi-K2.5",
        "messages": [{"role": "user", "content": "Natalia sold 48 clips. How many in May?"}],
        "max_tokens": 64,
        "temperature": 0,
        "rid": rid,
        "chat_template_kwargs": {"thinking": False},
    }


def _one(emu: ManagedProcess, rid: str) -> dict[str, Any]:
    with httpx.Client(base_url=emu.url, timeout=30) as client:
        response = client.post(
            "/v1/chat/completions", json=_body(rid), headers={"X-Emulator-Profile": "gsm8k"}
        )
        assert response.status_code == 200
        return record(client, rid)


def test_flags_parse_and_bad_values_are_refused() -> None:
    argv = ["emulate", "--step-time-scale", "2", "--accept-scale", "0.28"]
    config = config_from_args(build_parser().parse_args(argv))
    assert (config.step_time_scale, config.accept_scale) == (2.0, 0.28)
    with pytest.raises(ValueError, match="step_time_scale"):
        config_from_args(build_parser().parse_args(["emulate", "--step-time-scale", "0"]))
    with pytest.raises(ValueError, match="accept_scale"):
        config_from_args(build_parser().parse_args(["emulate", "--accept-scale", "1.5"]))


def test_running_cap_is_reported_in_loads_and_server_info(procs: ProcessManager) -> None:
    emu = procs.start([*EMULATE, "--max-running-requests", "6"], name="emu-cap")
    loads = httpx.get(emu.url + "/v1/loads?include=core,spec", timeout=5).json()["loads"][0]
    assert loads["max_running_requests"] == 6
    assert loads["max_total_num_tokens"] > 0
    info = httpx.get(emu.url + "/server_info", timeout=5).json()
    assert info["max_running_requests"] == 6
    assert info["context_length"] > 0


def test_slower_node_steps_and_prefills_take_longer_and_accept_the_same(
    procs: ProcessManager,
) -> None:
    normal = procs.start(EMULATE, name="emu-normal")
    slow = procs.start([*EMULATE, "--step-time-scale", "2"], name="emu-slow")
    fast_rec, slow_rec = _one(normal, "n1"), _one(slow, "s1")
    # One request alone on each node: the modelled step and prefill durations are exactly 2x.
    assert slow_rec["decode_s"] / slow_rec["steps"] == pytest.approx(
        2 * fast_rec["decode_s"] / fast_rec["steps"]
    )
    assert slow_rec["prefill_s"] == pytest.approx(2 * fast_rec["prefill_s"])
    # Same prompt and seed: the same tokens per step (speed is not acceptance).
    assert slow_rec["tokens_per_step"] == fast_rec["tokens_per_step"]


def test_mismatched_drafter_collapses_acceptance_in_loads(procs: ProcessManager) -> None:
    emu = procs.start([*EMULATE, "--accept-scale", "0.28"], name="emu-collapsed")
    rec = _one(emu, "c1")
    assert rec["spec_accept_length"] < 2.0  # gsm8k's 5.3 x 0.28 ~ 1.5
    loads = httpx.get(emu.url + "/v1/loads?include=core,spec", timeout=5).json()["loads"][0]
    assert loads["speculative"]["accept_length"] == pytest.approx(rec["spec_accept_length"])
