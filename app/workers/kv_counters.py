"""``KvEventCounters``: the KV event sink that counts, per worker, what the events reported.

Blocks and tokens stored and removed, caches cleared, and gaps (batches after missed ones),
as ``dflash_gateway_kv_events_*_total{worker}`` (docs/contracts.md, "Metrics"). Removed blocks
carry no tokens on the wire: they are counted at the block size the worker's last stored
batch had. An operator sees from them how fast each worker's cache turns over (removed tokens
per second against its ``max_total_num_tokens``) and whether the events arrive at all.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from app.metrics import Metrics
from app.workers.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent


class KvEventCounters:
    def __init__(self, recorder: Metrics, name_of: Callable[[str], str | None]) -> None:
        """``name_of``: a worker URL's name in the pool (None: no longer a member)."""
        self._recorder = recorder
        self._name_of = name_of
        self._block_size: dict[str, int] = {}

    def kv_events(self, worker_url: str, events: Sequence[KvEvent], *, gap: bool) -> None:
        name = self._name_of(worker_url)
        if name is None:
            return
        stored_blocks = stored_tokens = removed_blocks = clears = 0
        for event in events:
            if isinstance(event, BlockStored):
                stored_blocks += len(event.block_hashes)
                stored_tokens += len(event.token_ids)
                self._block_size[worker_url] = event.block_size
            elif isinstance(event, BlockRemoved):
                removed_blocks += len(event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                clears += 1
        size = self._block_size.get(worker_url, 0)
        self._recorder.record_kv_events(
            name,
            stored=(stored_blocks, stored_tokens),
            removed=(removed_blocks, removed_blocks * size),
            clears=clears,
            gap=gap,
        )
