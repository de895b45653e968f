"""``Names``: the sets of string values (item and part types, tool types, reasoning efforts...)
that a client's JSON value is tested against.

A JSON value may be a list or an object where a string belongs, and ``value in frozenset(...)``
then raises ``TypeError`` (neither can be hashed): a 500 with a traceback instead of the
caller's 400. A ``Names`` holds strings only and answers "not a member" for any value that is not
one, so every test against it, wherever the value was read, falls through to the 400 that names
the field.
"""

from __future__ import annotations


class Names(frozenset[str]):
    """A frozenset of strings whose membership test takes any JSON value."""

    __slots__ = ()

    def __contains__(self, value: object) -> bool:
        return isinstance(value, str) and frozenset.__contains__(self, value)
