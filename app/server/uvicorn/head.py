"""The raw size of a request's head, counted as its bytes are parsed, read by read.

A request's head is its request line, header lines and blank line. Its size is the same whether
the head comes in one read or many: a read that ends inside it adds its bytes; the read that holds
its blank line adds the bytes up to it (a blank line may straddle two reads). A head that begins
in the read that ended the request before it (pipelined) is counted from its parsed parts in that
read (target, header lines, and as few bytes for the rest as a valid head can have): where
exactly it began there is not known. Blank lines before a request are skipped, as the parser
skips them. Nothing here knows the parser: ``app.server.uvicorn.protocol`` tells it what was
parsed.
"""

from __future__ import annotations

from collections.abc import Callable

_HEAD_END = b"\r\n\r\n"


class HeadMeter:
    """The current request's head size (``size``), from the reads and what was parsed of them."""

    __slots__ = ("_began_here", "_ended_here", "_mid_read", "_parsed", "_read", "_tail", "size")

    def __init__(self) -> None:
        self.size = 0  # raw bytes of the current request's head so far
        self._tail = b""  # its last bytes: a blank line may straddle two reads
        self._parsed = 0  # its size as parsed: target + header lines (name: value CRLF)
        self._read = b""  # the read being parsed
        self._began_here = False  # the current head began in the read being parsed ...
        self._mid_read = False  # ... after the request before it ended in that read
        self._ended_here = False  # a request ended in the read being parsed

    def reading(self, data: bytes) -> None:
        """``data`` is about to be parsed."""
        self._read = data
        self._began_here = self._ended_here = False

    def read(self) -> None:
        """The read was parsed."""
        self._read = b""

    def began(self) -> None:
        """A request's first byte was parsed."""
        self._began_here = True
        self._mid_read = self._ended_here
        self.size = self._parsed = 0
        self._tail = b""

    def target(self, url: bytes) -> None:
        self._parsed += len(url)

    def header(self, name: bytes, value: bytes) -> None:
        self._parsed += len(name) + len(value) + 4

    def ended(self) -> None:
        """A request's body was parsed to its end."""
        self._ended_here = True

    def incomplete(self, data: bytes) -> int:
        """A read ended with the head incomplete: count its head bytes."""
        if not self._began_here:
            self.size += len(data)
        elif self._mid_read:
            self.size = self._parsed
        else:
            self.size = len(data.lstrip(b"\r\n"))  # blank lines before a request are skipped
        self._tail = (self._tail + data[-3:])[-3:]
        return self.size

    def complete(self, method: Callable[[], bytes]) -> int:
        """The head's size once its blank line was parsed in the current read (``method``: the
        request's method as parsed)."""
        data = self._read
        if not self._began_here:
            tail = self._tail
            straddled = (tail + data[:3]).find(_HEAD_END)
            end = straddled - len(tail) if straddled >= 0 else data.find(_HEAD_END)
            self.size += end + 4
        elif self._mid_read:  # method, spaces, version, CRLFs: as few as a valid head can have
            self.size = self._parsed + len(method()) + 14
        else:
            start = len(data) - len(data.lstrip(b"\r\n"))
            self.size = data.find(_HEAD_END, start) + 4 - start
        return self.size
