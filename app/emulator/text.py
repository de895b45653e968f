"""Deterministic text that reads like text: reasoning and answer tokens, per profile flavour.

One emitted token is one word piece (usually a word with its leading space); punctuation and
paragraph breaks are separate tokens, so token counts and text stay consistent. Everything comes
from the ``random.Random`` the caller passes in, so (prompt, seed) fixes the output.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from types import MappingProxyType

_REASONING = (
    "let me think about this carefully first we need to understand what the question asks "
    "the key observation is that each part depends on the previous one so we can work "
    "step by step and check the result at the end this means the total follows from the "
    "given values and we should verify the assumptions before we answer it also helps to "
    "restate the problem in simpler terms consider the constraints one more time then "
    "compare both approaches and choose the one that is easier to verify"
)
_FLAVOURS: MappingProxyType[str, str] = MappingProxyType(
    {
        "math": (
            "the answer is computed by adding the two amounts and then multiplying by the "
            "number of days so the result equals twelve plus eight which gives twenty and "
            "therefore the final value is forty dollars in total after the discount we "
            "subtract five percent from the price to get the remaining amount"
        ),
        "code": (
            "we define a function that iterates over the input list and keeps a running "
            "count of matching elements the helper returns early when the list is empty "
            "and otherwise builds the result with a dictionary lookup which keeps the "
            "solution linear in time and simple to test against the examples"
        ),
        "chat": (
            "here is a clear overview of the topic with a few practical suggestions you "
            "can start with a short plan then focus on the most important points and "
            "keep the tone friendly and concise many readers appreciate concrete examples "
            "so it helps to include one or two of them along with a brief summary"
        ),
    }
)
_PROFILE_FLAVOUR: MappingProxyType[str, str] = MappingProxyType(
    {"gsm8k": "math", "math500": "math", "humaneval": "code", "mbpp": "code", "mtbench": "chat"}
)


def flavour_words(profile: str) -> tuple[str, ...]:
    return tuple(_FLAVOURS[_PROFILE_FLAVOUR.get(profile, "chat")].split())


def prose(rng: random.Random, words: tuple[str, ...]) -> Iterator[str]:
    """An endless stream of sentence tokens: ``" word"`` pieces, ``"."`` and ``"\n\n"``.

    Each sentence is a run of consecutive words from the source passage (from a random start), so
    phrases read naturally."""
    first = True
    while True:
        start = rng.randrange(len(words))
        for i in range(rng.randint(6, 16)):
            word = words[(start + i) % len(words)]
            if i == 0:
                word = word.capitalize()
            yield word if first else " " + word
            first = False
        yield "."
        if rng.random() < 0.25:
            yield "\n\n"
            first = True


def reasoning_words() -> tuple[str, ...]:
    return tuple(_REASONING.split())


def split_pieces(text: str, size: int = 4) -> list[str]:
    """Cut a string into token-sized pieces (tool-call arguments)."""
    return [text[i : i + size] for i in range(0, len(text), size)] or [""]
