"""Workload profiles and the DFLASH per-position acceptance model.

A verify step drafts a block of 8 tokens; the target accepts the longest matching prefix of the
7 drafts and adds one bonus token, so a step emits ``accepted + 1`` tokens (1..8). The model draws
``accepted`` from per-position acceptance probabilities ``a_1..a_7`` with
``P(accepted >= j) = a_1 * ... * a_j``; the probabilities decline with depth
(``a_j = c * r**(j-1)``) and ``c`` is solved so that the mean tokens per step equals the
profile's tau.

Profiles (the seed's tau for Kimi-K2.5 at temperature 0): gsm8k 5.3, math500 5.5, humaneval 5.3,
mbpp 4.5, mtbench 3.7. Temperature lowers tau linearly, by a per-profile fraction at T=1
(DFLASH.md: ~8 % GSM8K, ~12 % chat, ~30 % competition math), clamped at T=2.

Content classifier (``--profile auto`` and no ``X-Emulator-Profile`` header), applied to the last
user turn (or the completion prompt), first match wins:

1. ``passes the tests`` together with a fenced code block -> ``humaneval`` (the seed's HumanEval
   prompt), also any prompt starting ``def `` or holding a triple-quoted doc string;
2. ``write a function`` / ``write a python function`` -> ``mbpp``;
3. ``\\boxed`` with LaTeX markup (``$``, ``\\frac``, ``^``) -> ``math500``;
4. ``\\boxed`` or digits with a question mark -> ``gsm8k``;
5. anything else -> ``mtbench``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from types import MappingProxyType

BLOCK_SIZE = 8
DRAFTS_PER_STEP = BLOCK_SIZE - 1
_DEPTH_DECAY = 0.97

PROFILE_TAU: MappingProxyType[str, float] = MappingProxyType(
    {"gsm8k": 5.3, "math500": 5.5, "humaneval": 5.3, "mbpp": 4.5, "mtbench": 3.7}
)
# Fraction of tau lost at temperature 1.0.
_TEMPERATURE_LOSS: MappingProxyType[str, float] = MappingProxyType(
    {"gsm8k": 0.08, "math500": 0.30, "humaneval": 0.10, "mbpp": 0.10, "mtbench": 0.12}
)
PROFILE_NAMES: tuple[str, ...] = tuple(PROFILE_TAU)
# The seed's output throughput (tok/s) for Kimi-K2.5 on one TP8 node at C=32.
SEED_OUTPUT_TPS: MappingProxyType[str, float] = MappingProxyType(
    {"gsm8k": 2015, "math500": 3096, "humaneval": 3146, "mbpp": 2940, "mtbench": 2146}
)


def step_time_factors() -> dict[str, float]:
    """Per-profile verify-step time relative to the mean, from the seed: a step at C=32 takes
    ``32 * tau / tok_s`` (GSM8K ~84 ms ... MBPP ~49 ms), so at ``--speed 1`` and 32 running each
    profile streams at its seed throughput."""
    steps = {p: 32 * PROFILE_TAU[p] / SEED_OUTPUT_TPS[p] for p in PROFILE_NAMES}
    mean = sum(steps.values()) / len(steps)
    return {p: step / mean for p, step in steps.items()}


@dataclass(frozen=True)
class AcceptanceModel:
    """Per-position draft acceptance probabilities for one block (7 drafts)."""

    probs: tuple[float, ...]

    @classmethod
    def for_tau(cls, tau: float) -> AcceptanceModel:
        """Solve the depth-decaying probabilities whose mean tokens per step is ``tau``."""
        tau = min(max(tau, 1.0), float(BLOCK_SIZE))
        lo, hi = 0.0, 1.0
        for _ in range(60):
            mid = (lo + hi) / 2
            if cls._from_scale(mid).mean_tokens() < tau:
                lo = mid
            else:
                hi = mid
        return cls._from_scale((lo + hi) / 2)

    @classmethod
    def _from_scale(cls, scale: float) -> AcceptanceModel:
        probs = tuple(min(scale * _DEPTH_DECAY**j, 1.0) for j in range(DRAFTS_PER_STEP))
        return cls(probs)

    def mean_tokens(self) -> float:
        """Expected tokens per verify step (accepted drafts + the bonus token)."""
        mean, survive = 1.0, 1.0
        for p in self.probs:
            survive *= p
            mean += survive
        return mean

    def sample_accepted(self, rng: random.Random) -> int:
        """Accepted drafts in one step, 0..7."""
        accepted = 0
        for p in self.probs:
            if rng.random() >= p:
                break
            accepted += 1
        return accepted


def effective_tau(profile: str, temperature: float) -> float:
    """The profile's tau lowered for sampling temperature."""
    tau = PROFILE_TAU[profile]
    t = min(max(temperature, 0.0), 2.0)
    return max(1.0, tau * (1.0 - _TEMPERATURE_LOSS[profile] * t))


class AcceptanceModels:
    """Solved models per (profile, temperature rounded to 0.05); owned by one emulator.

    ``scale`` multiplies every tau (floor 1): ``--accept-scale`` models a drafter that no longer
    matches its target (e.g. 0.28 gives ~1.3 tokens per step on the seed mix)."""

    def __init__(self, scale: float = 1.0) -> None:
        self._scale = scale
        self._cache: dict[tuple[str, float], AcceptanceModel] = {}

    def get(self, profile: str, temperature: float) -> AcceptanceModel:
        key = (profile, round(min(max(temperature, 0.0), 2.0) * 20) / 20)
        model = self._cache.get(key)
        if model is None:
            model = AcceptanceModel.for_tau(max(1.0, effective_tau(*key) * self._scale))
            self._cache[key] = model
        return model

    def collapsed(self, tau: float) -> AcceptanceModel:
        """The model of a collapsed drafter (the ``accept_collapse`` fault): mean ``tau`` tokens
        per step for every profile and temperature."""
        key = ("collapsed", round(tau, 3))
        model = self._cache.get(key)
        if model is None:
            model = AcceptanceModel.for_tau(tau)
            self._cache[key] = model
        return model


def classify(text: str) -> str:
    """The profile a prompt most resembles (see the module docstring for the rules)."""
    lowered = text.lower()
    if ("passes the tests" in lowered and "```" in text) or lowered.lstrip().startswith("def "):
        return "humaneval"
    if '"""' in text and "def " in text:
        return "humaneval"
    if "write a function" in lowered or "write a python function" in lowered:
        return "mbpp"
    if "\\boxed" in text:
        if "$" in text or "\\frac" in text or "^" in text:
            return "math500"
        return "gsm8k"
    if "?" in text and any(ch.isdigit() for ch in text):
        return "gsm8k"
    return "mtbench"
