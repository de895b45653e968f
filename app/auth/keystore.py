"""Client API keys: who may use the gateway, and under which name they appear in logs and metrics.

Keys come from ``--api-key`` (repeatable), ``DFLASH_GATEWAY_API_KEYS`` (comma-separated) and a keys
file (``auth.keys_file``, e.g. mounted from a Kubernetes Secret) that is re-read when it changes, so
a revoked key stops working without a restart. Each entry is ``NAME:KEY`` or a bare ``KEY``
(named ``key-<8 hex of its digest>``); blank lines and ``#`` comments are ignored in the file.

A key shorter than ``MIN_KEY_CHARS`` is refused, and so is an empty one: ``team-b:`` (the natural
way to revoke a key by hand) must not turn the string ``team-b:`` into a working key. The error
names the entry (file and line number, or the setting and position), never the key. At start-up a
bad entry stops the gateway (``ConfigError``); a reload that finds one keeps the previous key set
and logs why, so a half-edited Secret never locks everyone out nor lets anyone in.

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


MIN_KEY_CHARS = 16


class KeyEntryError(ValueError):
    """An entry that is not an acceptable key; the message names where it is, never the key."""


def parse_entry(raw: str, where: str = "entry") -> KeyEntry | None:
    """One ``NAME:KEY`` or bare ``KEY`` entry; None for a blank line or a ``#`` comment."""
    text = raw.strip()
    if not text or text.startswith("#"):
        return None
    name, sep, key = text.partition(":")
    name, key = name.strip(), key.strip()
    if not sep or not name:
        name, key = "", text
    elif not key:
        raise KeyEntryError(f"{where}: the key of {name!r} is empty (delete the line to revoke it)")
    if len(key) < MIN_KEY_CHARS:
        raise KeyEntryError(f"{where}: key shorter than {MIN_KEY_CHARS} characters")
    digest = _digest(key)
    return KeyEntry(name=name or f"key-{digest.hex()[:8]}", digest=digest)


def parse_entries(lines: Iterable[str], source: str = "entry") -> list[KeyEntry]:
    """Every entry of ``lines`` (``source`` names them in errors: ``<source> line <n>``)."""
    entries = []
    for number, line in enumerate(lines, 1):
        entry = parse_entry(line, f"{source} line {number}")
        if entry is not None:
            entries.append(entry)
    return entries


def check_keys(keys: Iterable[str], source: str) -> None:
    """Raise ``KeyEntryError`` for the first unacceptable entry (``<source> entry <n>``)."""
    for number, key in enumerate(keys, 1):
        parse_entry(key, f"{source} entry {number}")


def read_keys_file(path: Path) -> list[KeyEntry] | None:
    """The entries of a keys file; None when it cannot be read; ``KeyEntryError`` for a bad line."""
    try:
        content = path.read_bytes()
    except OSError:
        return None
    return parse_entries(content.decode("utf-8", "replace").splitlines(), str(path))


class KeyStore:
    """The accepted keys; ``open`` when none are configured at all."""

    def __init__(self, keys: Sequence[str] = (), keys_file: Path | None = None) -> None:
        """``KeyEntryError`` (a ``ValueError``) when an entry or a line of the file is bad."""
        self._static = [
            entry
            for number, key in enumerate(keys, 1)
            if (entry := parse_entry(key, f"api_keys entry {number}")) is not None
        ]
        self._file = keys_file
        self._file_entries: list[KeyEntry] = []
        self._file_stamp: tuple[int, int, bytes] | None = None
        if keys_file is not None:
            self.reload(strict=True)

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

    def reload(self, *, strict: bool = False) -> bool:
        """Re-read the keys file if it changed; returns True when the key set was replaced.
        An unreadable file keeps the last good set (a Secret update swaps a symlink), and so does
        a file with a bad line (logged; raised instead when ``strict``, as at start-up)."""
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
        try:
            entries = parse_entries(
                content.decode("utf-8", "replace").splitlines(), str(self._file)
            )
        except KeyEntryError as exc:
            if strict:
                raise
            log.error(
                "API keys file not reloaded: %s; keeping %d keys", exc, len(self._file_entries)
            )
            return False
        self._file_entries = entries
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
