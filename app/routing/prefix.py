"""A request's prompt as a chain of block keys over its raw bytes: what ``cache_aware`` looks up.

The prompt's raw JSON spans as the client wrote them (the ``tools`` array, then each message's
role and content; for text completions the ``prompt`` value), never a re-serialised copy, are
read as one byte stream cut every ``BLOCK_BYTES`` up to 64 KiB, every 16 KiB after that (~4k
tokens: 2 % of a 200k-token prompt, and a quarter of the keys to hash and look up). Each block's
key is the CRC-32 of the whole stream up to the block's end, carried from block to block
(``zlib.crc32(block, previous)``), with that end offset in the high bits: two prompts share a key
only where they share every byte before it, as a radix cache shares a prefix. A final partial
block gets a key too (a repeated short prompt matches whole). The chain costs about one CRC-32
pass over the bytes (an 800 KB prompt: ~0.5 ms on an idle core); a collision
needs the same offset and the same 32-bit checksum, and costs only a mis-estimate: the worker
matches its own cache exactly (a client crafting one only misroutes its own request).

What the keys do not cover: message fields other than role and content (an assistant's
``tool_calls``, a message's ``name``), and the chat template: two requests alike in those bytes
and different elsewhere would share keys they should not. Clients resend them unchanged turn
after turn, which is what this estimate is for.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import Any

BLOCK_BYTES = 4096
_FINE = 16  # blocks of BLOCK_BYTES up to 64 KiB, then of 4 x that: fewer keys for long prompts
_SEPARATOR = b"\0"  # between parts: never in a role, nor unescaped in JSON text


class PrefixBlocks:
    """A prompt's block keys and each block's end offset in bytes, with the total and ``lead``,
    the bytes of its shared lead (a chat's tools and system prompt: what many sessions share, as
    opposed to what one session adds from its first user turn on); ``picked`` is set by the
    policy that routed it (the worker's name and the prompt tokens it was estimated to hold), for
    the answer's ``cached_tokens`` to correct."""

    __slots__ = ("ends", "home", "keys", "last", "lead", "picked", "size")

    def __init__(
        self, keys: Sequence[int], ends: Sequence[int], size: int, lead: int = 0, last: int = 0
    ) -> None:
        self.keys = keys
        self.ends = ends
        self.size = size
        self.lead = lead
        # Where the last turn (the parts ``new_parts`` named) begins: before it, the history.
        self.last = last
        self.picked: tuple[str, int] | None = None
        # The worker any gateway replica last sent this session to (``shared_homes``), if read.
        self.home: str | None = None

    def __len__(self) -> int:
        return len(self.keys)


def prefix_blocks(
    parts: Sequence[Any], block: int = BLOCK_BYTES, *, lead_parts: int = 0, new_parts: int = 0
) -> PrefixBlocks | None:
    """The block chain of ``parts`` (bytes-like); None when there is nothing to hash.
    ``lead_parts``: how many leading parts make the shared lead; ``new_parts``: how many
    trailing ones the last turn (a chat's last message: 2)."""
    keys: list[int] = []
    lead = last = 0
    last_at = len(parts) - new_parts
    ends: list[int] = []
    crc = 0
    pos = 0  # bytes fed so far
    cut = block  # the next block's end
    for number, part in enumerate(parts):
        if number == lead_parts:
            lead = pos
        if number == last_at:
            last = pos
        view = memoryview(part)
        size = len(view) + 1
        start = 0
        # The part (then its separator) fed up to each block end it crosses.
        while pos + size - start >= cut:
            take = cut - pos
            if take > len(view) - start:  # the cut falls on the separator
                crc = zlib.crc32(view[start:], crc)
                crc = zlib.crc32(_SEPARATOR, crc)
                start = size
            else:
                crc = zlib.crc32(view[start : start + take], crc)
                start += take
            pos = cut
            keys.append(crc | cut << 32)
            ends.append(cut)
            cut += block if cut < _FINE * block else 4 * block
        if start < len(view):
            crc = zlib.crc32(view[start:], crc)
        if start < size:
            crc = zlib.crc32(_SEPARATOR, crc)
        pos += size - start
    if pos == 0:
        return None
    if lead_parts >= len(parts):
        lead = pos
    if last_at >= len(parts) or new_parts <= 0:
        last = pos
    if not ends or ends[-1] != pos:
        keys.append(crc | pos << 32)
        ends.append(pos)
    return PrefixBlocks(keys, ends, pos, lead, last)
