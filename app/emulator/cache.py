"""The emulated worker's prefix (radix) KV cache, bounded by ``--max-total-tokens``.

SGLang's radix cache, at page granularity (``--page-size``, 64 by default as SGLang forces for
the ``trtllm_mla`` backend Kimi-K2.5 runs on): the rendered prompt is cut into pages of
``page_size`` tokens (the emulator's tokenizer: 4 characters a token); each page is a node keyed
by a hash chained over every page before it, so a node's parent is the page before it and a hit
on page i means the whole prefix up to i matched. What SGLang does and this follows:

* a match counts whole leading pages only, and never the whole prompt: at most ``prompt_tokens
  - 1`` tokens, rounded down to a page (``schedule_batch.py`` ``_compute_max_prefix_len``);
* the prompt's pages are inserted once its prefill is done; a running request locks its path
  (``inc_lock_ref``) until it finishes, so it is never evicted under it;
* under pressure (cached pages + the running requests' other tokens above ``max_total_tokens``)
  the least recently used unlocked *leaf* goes first (``radix_cache.py`` ``evict``), so a
  prefix outlives every longer prompt that extends it;
* ``/flush_cache`` drops everything (refused while requests run, by the caller).

Bookkeeping is O(pages touched) per request: one ordered dict (LRU order, a node always more
recent than its children) of at most ``max_total_tokens // page_size`` nodes. Each node keeps
the SGLang block hash of its page (``event``) for the KV events (``app.emulator.kv_events``),
computed only when events are on and only for pages stored, so a 200k-token prompt whose prefix
is cached costs a chain of cheap digests, not a tokenizer.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from app.emulator.genrequest import CHARS_PER_TOKEN

DEFAULT_PAGE_SIZE = 64
# Kimi-K2.5's vocabulary: the emulator's token ids fall in it.
VOCAB_SIZE = 163840


def page_token_ids(text: str) -> list[int]:
    """The emulator's token ids for a page's text: one per 4 characters (its tokenizer has no
    vocabulary), the token's first 4 UTF-8 bytes as a little-endian number, modulo Kimi-K2.5's
    vocabulary size. ASCII text (4 bytes a token) is read in one pass."""
    raw = text.encode("utf-8", "surrogatepass")
    if len(raw) == len(text) and len(text) % CHARS_PER_TOKEN == 0:
        return [v % VOCAB_SIZE for v in struct.unpack(f"<{len(raw) // 4}I", raw)]
    ids = []
    for i in range(0, len(text), CHARS_PER_TOKEN):
        head = text[i : i + CHARS_PER_TOKEN].encode("utf-8", "surrogatepass")[:4]
        ids.append(int.from_bytes(head, "little") % VOCAB_SIZE)
    return ids


def sglang_block_hash(parent: bytes | None, token_ids: list[int]) -> bytes:
    """SGLang's page hash (``mem_cache/cpp_utils/hash_binding.cpp``): SHA-256 over the parent
    page's digest and the page's token ids as little-endian uint32."""
    digest = hashlib.sha256()
    if parent is not None:
        digest.update(parent)
    digest.update(struct.pack(f"<{len(token_ids)}I", *token_ids))
    return digest.digest()


def digest_to_int64(digest: bytes) -> int:
    """``hash_str_to_int64``: the first 8 bytes, as a signed big-endian int64."""
    return int.from_bytes(digest[:8], "big", signed=True)


class _Node:
    __slots__ = ("children", "digest", "locks", "parent")

    def __init__(self, parent: bytes | None, digest: bytes | None) -> None:
        self.parent = parent
        self.children = 0
        self.locks = 0
        self.digest = digest  # SGLang's page hash, only with events on


@dataclass(frozen=True)
class Stored:
    """Pages newly cached by one insert: their hashes, their parent's, their token ids."""

    hashes: list[int]
    parent: int | None
    token_ids: list[int]


@dataclass(frozen=True)
class Removed:
    hashes: list[int]


class Cleared:
    pass


CacheEvent = Stored | Removed | Cleared
Recorder = Callable[[list[CacheEvent]], None]


class PrefixCache:
    def __init__(
        self,
        max_total_tokens: int,
        page_size: int = DEFAULT_PAGE_SIZE,
        *,
        recorder: Recorder | None = None,
    ) -> None:
        if page_size < 1:
            raise ValueError("page_size must be >= 1")
        self.page_size = page_size
        self.page_chars = page_size * CHARS_PER_TOKEN
        self.max_total_tokens = max_total_tokens
        self._nodes: OrderedDict[bytes, _Node] = OrderedDict()
        self._recorder = recorder
        self.hit_tokens = 0
        self.lookup_tokens = 0
        self.evicted_tokens = 0

    def keys(self, prompt: str) -> list[bytes]:
        """The chain keys of the prompt's whole pages."""
        keys: list[bytes] = []
        digest = b""
        step = self.page_chars
        for start in range(0, len(prompt) - step + 1, step):
            page = prompt[start : start + step].encode("utf-8", "surrogatepass")
            digest = hashlib.blake2b(digest + page, digest_size=16).digest()
            keys.append(digest)
        return keys

    def _matched(self, keys: list[bytes], prompt_tokens: int) -> list[bytes]:
        """The prompt's leading pages in the cache: whole pages, never the last token."""
        limit = max(0, prompt_tokens - 1) // self.page_size
        nodes = self._nodes
        path: list[bytes] = []
        for key in keys[:limit]:
            if key not in nodes:
                break
            path.append(key)
        return path

    def peek(self, keys: list[bytes], prompt_tokens: int) -> int:
        """Cached tokens for this prompt now, with nothing locked, touched or counted."""
        return len(self._matched(keys, prompt_tokens)) * self.page_size

    def match(self, keys: list[bytes], prompt_tokens: int) -> tuple[int, list[bytes]]:
        """Cached tokens for this prompt and the matched path, locked until ``unlock``."""
        path = self._matched(keys, prompt_tokens)
        nodes = self._nodes
        for key in path:
            nodes[key].locks += 1
        self._touch(path)
        cached = len(path) * self.page_size
        self.hit_tokens += cached
        self.lookup_tokens += prompt_tokens
        return cached, path

    def insert(
        self, prompt: str, keys: list[bytes], held: list[bytes], reserved: int
    ) -> list[bytes]:
        """Cache the prompt's pages after its prefill; ``held`` is the path ``match`` locked and
        ``reserved`` the tokens running requests hold outside the cache. Returns the whole locked
        path (the caller unlocks it when the request finishes)."""
        nodes = self._nodes
        events = self._recorder is not None
        path = list(held)
        stored: list[int] = []
        token_ids: list[int] = []
        parent_key = path[-1] if path else None
        first_parent = nodes[parent_key].digest if parent_key is not None else None
        for i in range(len(path), len(keys)):
            key = keys[i]
            node = nodes.get(key)
            if node is None:
                parent_digest = nodes[parent_key].digest if parent_key is not None else None
                digest = None
                if events:
                    ids = page_token_ids(prompt[i * self.page_chars : (i + 1) * self.page_chars])
                    digest = sglang_block_hash(parent_digest, ids)
                    if not stored:
                        first_parent = parent_digest
                    stored.append(digest_to_int64(digest))
                    token_ids.extend(ids)
                node = _Node(parent_key, digest)
                nodes[key] = node
                if parent_key is not None:
                    nodes[parent_key].children += 1
            elif stored:
                # An existing page after new ones: the store event ends here (it is not new).
                self._emit([Stored(stored, _int(first_parent), token_ids)])
                stored, token_ids = [], []
            node.locks += 1
            path.append(key)
            parent_key = key
        self._touch(path)
        if stored:
            self._emit([Stored(stored, _int(first_parent), token_ids)])
        self._evict(reserved)
        return path

    def unlock(self, path: list[bytes]) -> None:
        nodes = self._nodes
        for key in path:
            node = nodes.get(key)
            if node is not None and node.locks:
                node.locks -= 1

    def _touch(self, path: list[bytes]) -> None:
        """Most recently used: children first, so every node stays more recent than its
        children and the oldest node is always a leaf."""
        move = self._nodes.move_to_end
        for key in reversed(path):
            move(key)

    def _evict(self, reserved: int) -> None:
        nodes = self._nodes
        budget = max(0, self.max_total_tokens - reserved) // self.page_size
        removed: list[int] = []
        skipped = 0
        while len(nodes) > budget and skipped < len(nodes):
            key, node = nodes.popitem(last=False)
            if node.locks or node.children:
                nodes[key] = node  # in use: it stays (SGLang evicts only unlocked)
                skipped += 1
                continue
            skipped = 0
            if node.parent is not None:
                parent = nodes.get(node.parent)
                if parent is not None:
                    parent.children -= 1
            self.evicted_tokens += self.page_size
            if node.digest is not None:
                removed.append(digest_to_int64(node.digest))
        if removed:
            self._emit([Removed(removed)])

    def flush(self) -> None:
        self._nodes.clear()
        self._emit([Cleared()])

    def _emit(self, events: list[CacheEvent]) -> None:
        if self._recorder is not None:
            self._recorder(events)

    @property
    def used_tokens(self) -> int:
        return len(self._nodes) * self.page_size

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.lookup_tokens if self.lookup_tokens else 0.0


def _int(digest: bytes | None) -> int | None:
    return None if digest is None else digest_to_int64(digest)
