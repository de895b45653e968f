"""``uvicorn.Server`` with its signal handling open to a subclass or to another server.

``Server`` is ``uvicorn.Server`` with its signal handling open to a subclass (``intercept``) or left
to another server in the same loop (``owns_signals = False``). It overrides ``handle_exit`` and
``capture_signals``, which uvicorn does not document: checked in
``tests/server/test_uvicorn_contract.py`` with the rest.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from types import FrameType

import uvicorn


class Server(uvicorn.Server):
    """``uvicorn.Server``; ``started`` and ``should_exit`` are its own (public) flags."""

    owns_signals = True  # False: another server in this loop handles SIGINT/SIGTERM

    def intercept(self, sig: int) -> bool:
        """A shutdown signal arrived: True if handled here, else uvicorn stops as usual."""
        return False

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if not self.intercept(sig):
            super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if self.owns_signals:
            with super().capture_signals():
                yield
        else:
            yield
