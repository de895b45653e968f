"""Acceptance calibration from the emulator's own ground truth, in-process with fixed seeds."""

from __future__ import annotations

import random

import pytest

from app.emulator.generation import Generation
from app.emulator.genrequest import GenRequest
from app.emulator.profiles import (
    PROFILE_NAMES,
    PROFILE_TAU,
    AcceptanceModel,
    AcceptanceModels,
    classify,
    effective_tau,
)

REQUESTS = 120


def _request(i: int, max_tokens: int | None = None, temperature: float = 0.0) -> GenRequest:
    prompt = f"question {i}: how many apples are left?"
    return GenRequest(
        kind="chat",
        model="m",
        prompt=prompt,
        last_user=prompt,
        max_tokens=max_tokens,
        temperature=temperature,
        thinking=True,
    )


def _run(gen: Generation) -> None:
    while gen.next_step() is not None:
        pass


def _mean_accept_length(profile: str, temperature: float, seed: int) -> float:
    models = AcceptanceModels()
    lengths = []
    for i in range(REQUESTS):
        req = _request(i, temperature=temperature)
        gen = Generation(req, profile, models.get(profile, temperature), random.Random(seed + i))
        _run(gen)
        steps = gen.step_tokens
        assert all(1 <= t <= 8 for t in steps)
        assert sum(steps) == gen.completion_tokens
        lengths.append(gen.completion_tokens / len(steps))  # SGLang's per-request value
    return sum(lengths) / len(lengths)


@pytest.mark.parametrize("profile", PROFILE_NAMES)
def test_unweighted_mean_accept_length_within_3_percent(profile: str) -> None:
    tau = PROFILE_TAU[profile]
    mean = _mean_accept_length(profile, 0.0, seed=1000)
    assert abs(mean - tau) / tau <= 0.03, (profile, mean, tau)


def test_temperature_lowers_tau() -> None:
    hot = _mean_accept_length("math500", 1.0, seed=2000)
    expected = effective_tau("math500", 1.0)
    assert expected < PROFILE_TAU["math500"] * 0.75
    assert abs(hot - expected) / expected <= 0.03


def test_model_mean_is_solved_exactly() -> None:
    for tau in (1.0, 2.5, 3.7, 4.5, 5.3, 5.5):
        assert AcceptanceModel.for_tau(tau).mean_tokens() == pytest.approx(tau, abs=1e-6)


def test_final_short_step_at_max_tokens() -> None:
    models = AcceptanceModels()
    short_finals = 0
    for i in range(200):
        gen = Generation(
            _request(i, max_tokens=37), "gsm8k", models.get("gsm8k", 0), random.Random(i)
        )
        _run(gen)
        assert gen.completion_tokens == 37 and gen.finish_reason == "length"
        assert all(1 <= t <= 8 for t in gen.step_tokens)
        # The truncated last step still counts as one verify step, as in SGLang's
        # spec_accept_length = completion_tokens / spec_verify_ct.
        assert sum(gen.histogram()) == len(gen.step_tokens)
        short_finals += gen.step_tokens[-1] < 8
    assert short_finals > 0


def test_classifier_rules() -> None:
    boxed = "\nPlease reason step by step, and put your final answer within \\boxed{}."
    assert classify("Natalia sold 48 clips in April." + boxed) == "gsm8k"
    assert classify("Find $x$ such that $x^2 = 4$." + boxed) == "math500"
    humaneval = "Write a solution to the following problem and make sure that it passes the tests:"
    assert classify(humaneval + "\n```python\ndef f(x):\n```") == "humaneval"
    assert classify("Write a function to find the shared elements of two lists.") == "mbpp"
    assert classify("Compose an engaging travel blog post about Hawaii.") == "mtbench"
