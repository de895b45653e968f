"""Token log-probabilities in SGLang's two OpenAI shapes, with deterministic plausible values.

Every generated token is listed, hidden ones included (``</think>``, the kimi_k2 tool-call markers,
``<|im_end|>``), with the text SGLang's ``detokenize_logprob_tokens`` gives it. The sampled token's
log-probability is near 0 most of the time (accepted drafts are likely tokens); with
``top_logprobs`` k > 0 it is the first of k alternatives in falling order (greedy picks the top).

Shapes (``sglang/srt/entrypoints/openai``):

* chat (``serving_chat.py`` ``_build_token_logprobs_from_raw``, ``protocol.py``
  ``ChoiceLogprobs``): ``{"content": [{"token", "bytes", "logprob", "top_logprobs": [{"token",
  "bytes", "logprob"}]}]}``; ``bytes`` the token's UTF-8 bytes.
* text completions (``utils.py`` ``to_openai_style_logprobs``, ``protocol.py`` ``LogProbs``):
  ``{"text_offset": [-1, ...], "token_logprobs", "tokens", "top_logprobs"}``; ``text_offset`` is
  always -1 ("not supported yet"); ``top_logprobs`` holds one ``{token: logprob}`` per token when
  ``logprobs`` > 0 and is empty when ``logprobs`` is 0.

Streams carry, per chunk, the tokens new since the previous chunk of that choice.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass
from typing import Any

_ALTERNATIVES = (
    " the",
    " a",
    " and",
    " to",
    " of",
    " is",
    " that",
    " we",
    " it",
    " this",
    " in",
    " for",
    ",",
    ".",
    " so",
    " be",
    " with",
    " as",
    " on",
    " can",
    " which",
    " then",
    " each",
    " one",
    " first",
    " all",
    " by",
    " an",
    " not",
    " are",
    " at",
    " from",
    " or",
    " more",
    " if",
    " but",
    " value",
    " step",
    " result",
    " number",
    " answer",
    " total",
    " case",
    " two",
    " next",
    " let",
    " now",
    " our",
    " its",
    " time",
    " way",
    " here",
    " also",
    " when",
    " only",
    " there",
    " what",
    " how",
    " both",
    " same",
    " new",
    " part",
    " list",
    " other",
)


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    token: str
    logprob: float
    top: tuple[tuple[str, float], ...]  # (token, logprob), most likely first; empty if k = 0


class LogprobSource:
    """Deterministic per (request, choice): the same request gets the same values."""

    def __init__(self, material: str, top: int) -> None:
        seed = hashlib.blake2b(material.encode(), digest_size=8).digest()
        self._rng = random.Random(int.from_bytes(seed))
        self._top = top

    def token(self, text: str) -> TokenLogprob:
        rng = self._rng
        logprob = -(rng.random() ** 4) * 3.0
        if not self._top:
            return TokenLogprob(text, logprob, ())
        top = [(text, logprob)]
        seen = {text}
        current = logprob
        while len(top) < self._top:
            alt = _ALTERNATIVES[rng.randrange(len(_ALTERNATIVES))]
            if alt in seen:
                alt = f"{alt}{len(top)}"  # keep the tokens of one position distinct
            seen.add(alt)
            current -= 0.5 + rng.random() * 2.0
            top.append((alt, current))
        return TokenLogprob(text, logprob, tuple(top))


def chat(entries: list[TokenLogprob]) -> dict[str, Any]:
    return {
        "content": [
            {
                "token": e.token,
                "bytes": list(e.token.encode()),
                "logprob": e.logprob,
                "top_logprobs": [
                    {"token": t, "bytes": list(t.encode()), "logprob": lp} for t, lp in e.top
                ],
            }
            for e in entries
        ]
    }


def completion(entries: list[TokenLogprob], top: bool) -> dict[str, Any]:
    return {
        "text_offset": [-1] * len(entries),
        "token_logprobs": [e.logprob for e in entries],
        "tokens": [e.token for e in entries],
        "top_logprobs": [dict(e.top) for e in entries] if top else [],
    }
