"""A prefix (radix-like) KV cache model: repeated prompt prefixes report ``cached_tokens``.

The rendered prompt is cut into blocks of ``BLOCK_CHARS`` characters (16 tokens at 4 characters a
token); each block is keyed by a hash chained over all blocks before it, so a hit on block i means
the whole prefix up to i matched. Blocks live in an LRU bounded by ``capacity_tokens``. Only whole
leading blocks count as cached, and never the whole prompt (the last token is always computed).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

from app.emulator.requests import CHARS_PER_TOKEN

BLOCK_CHARS = 64
BLOCK_TOKENS = BLOCK_CHARS // CHARS_PER_TOKEN


class PrefixCache:
    def __init__(self, capacity_tokens: int) -> None:
        self._capacity = max(1, capacity_tokens // BLOCK_TOKENS)
        self._blocks: OrderedDict[bytes, None] = OrderedDict()
        self.hit_tokens = 0
        self.lookup_tokens = 0

    @staticmethod
    def keys(prompt: str) -> list[bytes]:
        keys: list[bytes] = []
        digest = b""
        for start in range(0, len(prompt) - BLOCK_CHARS + 1, BLOCK_CHARS):
            block = prompt[start : start + BLOCK_CHARS].encode()
            digest = hashlib.blake2b(digest + block, digest_size=16).digest()
            keys.append(digest)
        return keys

    def match(self, keys: list[bytes], prompt_tokens: int) -> int:
        """Cached tokens for this prompt (and the hit-rate bookkeeping)."""
        hits = 0
        for key in keys:
            if key not in self._blocks:
                break
            self._blocks.move_to_end(key)
            hits += 1
        cached = min(hits * BLOCK_TOKENS, max(0, prompt_tokens - 1))
        self.hit_tokens += cached
        self.lookup_tokens += prompt_tokens
        return cached

    def insert(self, keys: list[bytes]) -> None:
        for key in keys:
            self._blocks[key] = None
            self._blocks.move_to_end(key)
        while len(self._blocks) > self._capacity:
            self._blocks.popitem(last=False)

    def flush(self) -> None:
        self._blocks.clear()

    @property
    def used_tokens(self) -> int:
        return len(self._blocks) * BLOCK_TOKENS

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.lookup_tokens if self.lookup_tokens else 0.0
