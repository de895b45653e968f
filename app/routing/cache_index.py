"""Where each prompt prefix lives: per worker, the block keys (``app.routing.prefix``) of the
prompts the gateway sent it, in least-recently-used order, bounded by the worker's KV capacity.

- **Recorded** when a request is routed: the chosen worker now holds every block of its prompt
  (SGLang inserts the prompt into its radix cache as it runs). The blocks are touched last one
  first, so a prompt's leading blocks are the most recent and the deep ones go first, as a radix
  cache evicts leaves before the nodes they hang from.
- **Aged** in step with the worker: a worker holds at most its reported ``max_total_num_tokens``
  (its KV pool: what the radix cache and the running requests share) of our blocks, times a
  factor the answers correct; beyond it the least recently used blocks go, as SGLang's LRU
  eviction would.
- **Corrected** by every answer: ``cached_tokens`` is what the worker actually held of the
  prompt. Well below the estimate, the worker evicts faster than this gateway's own traffic
  explains (other replicas, other clients): its budget shrinks below what our entries hold now.
  An answer that held what was estimated lets it grow back (to its capacity). Only the part past
  the shared lead counts: sessions that start together all miss the lead until the first
  prefill is done, which is no eviction.
- **KV events** (``kv_events``, the ``KvEventSink`` of ``app.workers.kv_events``): a worker's
  BlockRemoved events evict the same number of tokens from its entries here, oldest first;
  AllBlocksCleared forgets the worker. The engine's block hashes are over token ids, which a
  gateway without the tokenizer cannot compute from raw text, so which of our blocks go is the
  LRU's choice; how many is the worker's. A gap in the events changes nothing (capacity aging
  still bounds the estimate).

Tokens are estimated from bytes with a ratio learned from the answers (``prompt_tokens`` over the
prompt's raw bytes, an EWMA; 1 token per 4 bytes before any answer).

Memory: at most ``capacity / tokens per block`` entries per worker (~2,000 for a 1M-token worker
at 2 KiB blocks) and never more than ``max_blocks`` per worker; a worker that leaves is
forgotten by ``retain``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any

from app.routing.prefix import BLOCK_BYTES, PrefixBlocks

DEFAULT_CAPACITY_TOKENS = 1_000_000  # until the worker reports max_total_num_tokens
_TOKENS_PER_BYTE = 0.25
_RATIO_ALPHA = 0.05
_FACTOR_MIN = 0.01
_SHRINK = 0.9  # the factor after an answer that held much less than estimated
_GROW = 1.02  # and after one that held what was estimated, or more


class _Held:
    """One worker's blocks: key -> estimated tokens, least recently used first."""

    __slots__ = ("blocks", "capacity", "engine", "factor", "tokens", "url")

    def __init__(self) -> None:
        self.blocks: OrderedDict[int, int] = OrderedDict()
        self.tokens = 0
        self.capacity = DEFAULT_CAPACITY_TOKENS
        self.factor = 1.0
        self.url = ""
        # The engine's own block hashes seen stored (KV events), with their sizes in tokens.
        self.engine: OrderedDict[Any, int] = OrderedDict()


class PrefixIndex:
    def __init__(self, *, max_blocks: int = 1 << 16) -> None:
        self._held: dict[str, _Held] = {}
        self._by_url: dict[str, str] = {}
        self._max_blocks = max_blocks
        self.tokens_per_byte = _TOKENS_PER_BYTE

    # -- reading ------------------------------------------------------------------------------

    def tokens(self, byte_count: int) -> int:
        return int(byte_count * self.tokens_per_byte)

    def held_tokens(self, worker: str, blocks: PrefixBlocks) -> int:
        """Prompt tokens ``worker`` is estimated to hold of ``blocks``: up to the deepest block it
        holds (a binary search: the blocks of a prefix are held together, deepest going first)."""
        held = self._held.get(worker)
        if held is None or not blocks.keys:
            return 0
        have = held.blocks
        keys = blocks.keys
        if keys[0] not in have:
            return 0
        low, high = 0, len(keys) - 1  # keys[low] held; find the last held
        while low < high:
            mid = (low + high + 1) >> 1
            if keys[mid] in have:
                low = mid
            else:
                high = mid - 1
        return int(blocks.ends[low] * self.tokens_per_byte)

    @property
    def held_map(self) -> dict[str, _Held]:
        """Each worker's entries (read by the policy's scan: ``blocks`` holds its keys)."""
        return self._held

    @property
    def workers(self) -> int:
        return len(self._held)

    def worker_tokens(self, worker: str) -> int:
        held = self._held.get(worker)
        return held.tokens if held is not None else 0

    # -- writing ------------------------------------------------------------------------------

    def _of(self, worker: str) -> _Held:
        held = self._held.get(worker)
        if held is None:
            held = self._held[worker] = _Held()
        return held

    def set_capacity(self, worker: str, url: str, capacity_tokens: int | None) -> None:
        """The worker's KV pool size (``max_total_num_tokens``) and URL (KV events name it)."""
        held = self._of(worker)
        if url != held.url:
            self._by_url.pop(held.url, None)
            held.url = url
            self._by_url[url] = worker
        if capacity_tokens and capacity_tokens != held.capacity:
            held.capacity = capacity_tokens
            self._trim(held)

    def record(self, worker: str, blocks: PrefixBlocks) -> None:
        """``worker`` was sent this prompt: it holds every block of it now."""
        held = self._of(worker)
        have = held.blocks
        ends = blocks.ends
        ratio = self.tokens_per_byte
        added = 0
        for i in range(len(blocks.keys) - 1, -1, -1):
            key = blocks.keys[i]
            if key in have:
                have.move_to_end(key)
            else:
                start = ends[i - 1] if i else 0
                size = max(1, int((ends[i] - start) * ratio))
                have[key] = size
                added += size
        held.tokens += added
        if added:
            self._trim(held)

    def answered(self, worker: str, blocks: PrefixBlocks, prompt: int, cached: int | None) -> None:
        """The worker's answer to a prompt routed with ``blocks``: ``prompt`` tokens, of which
        ``cached`` came from its prefix cache (None: not reported)."""
        if blocks.size and prompt:
            self.tokens_per_byte += _RATIO_ALPHA * (prompt / blocks.size - self.tokens_per_byte)
        picked = blocks.picked
        if cached is None or picked is None or picked[0] != worker:
            return
        held = self._held.get(worker)
        if held is None:
            return
        # Only the session's own part counts: requests that share a lead and arrive together
        # all miss it until the first one's prefill is done, which says nothing of eviction.
        lead = self.tokens(blocks.lead)
        estimate = picked[1]
        slack = max(prompt // 20, 2 * self.tokens(BLOCK_BYTES))
        if max(cached, lead) + slack < estimate:
            # It kept less than our entries say (it evicts faster than our traffic explains):
            # its budget goes a step below what our entries hold now.
            now = min(held.factor, held.tokens / held.capacity)
            held.factor = max(_FACTOR_MIN, now * _SHRINK)
            self._trim(held)
        elif cached + slack >= estimate:
            held.factor = min(1.0, held.factor * _GROW)

    def evict_tokens(self, worker: str, tokens: int) -> None:
        """The worker dropped ``tokens`` of its cache: as many of ours go, oldest first."""
        held = self._held.get(worker)
        if held is None:
            return
        have = held.blocks
        while tokens > 0 and have:
            _, size = have.popitem(last=False)
            held.tokens -= size
            tokens -= size

    def forget(self, worker: str) -> None:
        """The worker holds nothing (restarted, flushed, cleared)."""
        held = self._held.get(worker)
        if held is not None:
            held.blocks.clear()
            held.tokens = 0

    def retain(self, workers: Iterable[str]) -> None:
        """Forget every worker not in ``workers`` (they left the pool)."""
        keep = set(workers)
        for name in [name for name in self._held if name not in keep]:
            self._by_url.pop(self._held.pop(name).url, None)

    def _trim(self, held: _Held) -> None:
        budget = int(held.capacity * held.factor)
        have = held.blocks
        while have and (held.tokens > budget or len(have) > self._max_blocks):
            _, size = have.popitem(last=False)
            held.tokens -= size

    # -- KV events (app.workers.kv_events.KvEventSink) ----------------------------------------

    def kv_events(self, worker_url: str, events: Sequence[Any], *, gap: bool) -> None:
        """A batch of a worker's KV events. BlockRemoved evicts the removed blocks' tokens here
        (their sizes from the BlockStored events seen); AllBlocksCleared forgets the worker."""
        name = self._by_url.get(worker_url.rstrip("/"))
        if name is None:
            return
        held = self._held[name]
        sizes = held.engine
        for event in events:
            kind = type(event).__name__
            if kind == "BlockStored":
                size = int(getattr(event, "block_size", 0) or 0)
                for block_hash in getattr(event, "block_hashes", ()):
                    sizes[block_hash] = size
                while len(sizes) > 4 * self._max_blocks:
                    sizes.popitem(last=False)
            elif kind == "BlockRemoved":
                removed = 0
                for block_hash in getattr(event, "block_hashes", ()):
                    removed += sizes.pop(block_hash, 0)
                if removed:
                    self.evict_tokens(name, removed)
            elif kind == "AllBlocksCleared":
                sizes.clear()
                self.forget(name)
