"""Ground truth: one record per finished request, totals, and the ``--stats-file`` JSONL copy.

One record per generation: a request with several choices (``n``, a batch of prompts) leaves one
per choice, each with its own rid and its choice ``index``.

A record: ``rid, request_id (the X-Request-Id header, if any), kind, index, profile, stream,
priority (SGLang's ``priority`` field as received, null when absent), steps, tokens_per_step,
completion_tokens, reasoning_tokens, prompt_tokens, cached_tokens, prefill_s (the modelled
prefill time, shortened by cached tokens), spec_accept_length, finish_reason, aborted (null |
"abort" | "disconnect"), error (null | fault name), chunks_sent, started, first_token, finished``
(Unix seconds). The last 20,000 are kept in memory; all are appended to the file as they
finish, so they survive the process being killed.
"""

from __future__ import annotations

from collections import deque
from pathlib import Path
from typing import IO, Any

import orjson

_TOTAL_KEYS = (
    "requests",
    "finished",
    "aborted",
    "disconnects",
    "failed",
    "queue_rejected",
    "prompt_tokens",
    "cached_tokens",
    "completion_tokens",
    "reasoning_tokens",
    "verify_steps",
    "chunks_sent",
)


class StatsBook:
    def __init__(self, path: Path | None = None, keep: int = 20_000) -> None:
        self.records: deque[dict[str, Any]] = deque(maxlen=keep)
        self.totals: dict[str, int] = dict.fromkeys(_TOTAL_KEYS, 0)
        self._file: IO[bytes] | None = path.open("ab") if path is not None else None

    def count(self, key: str, value: int = 1) -> None:
        self.totals[key] += value

    def add(self, record: dict[str, Any]) -> None:
        self.records.append(record)
        t = self.totals
        t["finished"] += 1
        if record["aborted"] == "disconnect":
            t["disconnects"] += 1
        elif record["aborted"]:
            t["aborted"] += 1
        t["prompt_tokens"] += record["prompt_tokens"]
        t["cached_tokens"] += record["cached_tokens"]
        t["completion_tokens"] += record["completion_tokens"]
        t["reasoning_tokens"] += record["reasoning_tokens"]
        t["verify_steps"] += record["steps"]
        t["chunks_sent"] += record["chunks_sent"]
        if self._file is not None:
            self._file.write(orjson.dumps(record) + b"\n")
            self._file.flush()

    def snapshot(
        self, active: list[str], rid_prefix: str = "", limit: int | None = None
    ) -> dict[str, Any]:
        """Totals, active rids and the records (those whose rid starts with ``rid_prefix``; the
        last ``limit`` of them). The mean accept length is over all kept records."""
        totals: dict[str, Any] = dict(self.totals)
        steps = totals["verify_steps"]
        totals["token_weighted_accept_length"] = (
            totals["completion_tokens"] / steps if steps else None
        )
        lengths = [r["spec_accept_length"] for r in self.records if r["spec_accept_length"]]
        totals["mean_spec_accept_length"] = sum(lengths) / len(lengths) if lengths else None
        records = [r for r in self.records if r["rid"].startswith(rid_prefix)]
        if limit is not None:
            records = records[-limit:] if limit > 0 else []
        return {"totals": totals, "active": active, "requests": records}

    def reset(self) -> None:
        self.records.clear()
        self.totals = dict.fromkeys(_TOTAL_KEYS, 0)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
