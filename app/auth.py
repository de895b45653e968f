"""Client API keys: who may use the gateway, and under which name they appear in logs and metrics.

Keys come from ``--api-key`` (repeatable), ``DFLASH_GATEWAY_API_KEYS`` (comma-separated) and a keys
file (``auth.keys_file``, e.g. mounted from a Kubernetes Secret) that is re-read when it changes, so
a revoked key stops working without a restart. Each entry is ``NAME:KEY`` or a bare ``KEY``
(named ``key-<8 hex of its digest>``); blank lines and ``#`` comments are ignored in the file.

Only SHA-256 digests are kept. A presented key is hashed and compared against every digest with
``hmac.compare_digest`` (no early exit), so timing reveals neither which key nor how much of it
matched. The key itself never reaches logs or metrics: only its name does.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


@dataclass(frozen=True, slots=True)
class KeyEntry:
    name: str
    digest: bytes


def parse_entry(raw: str) -> KeyEntry | None:
    text = raw.strip()
    if not text or text.startswith("#"):
        return None
    name, sep, key = text.partition(":")
    if not sep or not key.strip() or not name.strip():
        key, name = text, ""
    key = key.strip()
    digest = _digest(key)
    return KeyEntry(name=name.strip() or f"key-{digest.hex()[:8]}", digest=digest)


def parse_entries(lines: Iterable[str]) -> list[KeyEntry]:
    return [entry for entry in map(parse_entry, lines) if entry is not None]


class KeyStore:
    """The accepted keys; ``open`` when none are configured at all."""

    def __init__(self, keys: Sequence[str] = (), keys_file: Path | None = None) -> None:
        self._static = parse_entries(keys)
        self._file = keys_file
        self._file_entries: list[KeyEntry] = []
        self._file_stamp: tuple[int, int, bytes] | None = None
        if keys_file is not None:
            self.reload()

    @property
    def open(self) -> bool:
        return not self._static and self._file is None

    def names(self) -> list[str]:
        """Configured key names: the only values the per-key metric label takes."""
        return sorted({entry.name for entry in (*self._static, *self._file_entries)})

    def authenticate(self, presented: str | None) -> str | None:
        """The key's name if ``presented`` is an accepted key, else None."""
        if not presented:
            return None
        digest = _digest(presented)
        found: str | None = None
        for entry in (*self._static, *self._file_entries):
            if hmac.compare_digest(entry.digest, digest) and found is None:
                found = entry.name
        return found

    def reload(self) -> bool:
        """Re-read the keys file if it changed; returns True when the key set was replaced.
        An unreadable file keeps the last good set (a Secret update swaps a symlink)."""
        if self._file is None:
            return False
        try:
            content = self._file.read_bytes()
            stat = self._file.stat()
        except OSError as exc:
            log.warning(
                "cannot read API keys file %s: %s; keeping %d keys",
                self._file,
                exc.strerror,
                len(self._file_entries),
            )
            return False
        stamp = (stat.st_mtime_ns, stat.st_size, hashlib.sha256(content).digest())
        if stamp == self._file_stamp:
            return False
        self._file_stamp = stamp
        self._file_entries = parse_entries(content.decode("utf-8", "replace").splitlines())
        log.info("loaded %d API keys from %s", len(self._file_entries), self._file)
        return True

    async def watch(self, interval_s: float, on_change: Callable[[], None] | None = None) -> None:
        """Reload the keys file every ``interval_s`` until cancelled; ``on_change`` runs after
        each reload that replaced the key set."""
        while True:
            await asyncio.sleep(interval_s)
            if self.reload() and on_change is not None:
                on_change()


def bearer_token(authorization: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header."""
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    if scheme.lower() != "bearer":
        return None
    return token.strip() or None
