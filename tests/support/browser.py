"""A headless Chromium driven over the DevTools protocol on a pipe (``--remote-debugging-pipe``):
no extra package, no browser download, nothing listening on a port.

Chromium reads commands from its fd 3 and writes answers and events to its fd 4, each message a
JSON object followed by a NUL byte. ``Browser`` starts it, opens one tab, and offers what the
rendering tests need: set the viewport, load a URL and wait for its ``load`` event, evaluate a
script and return its value.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

FLAGS = (
    "--headless",
    "--remote-debugging-pipe",
    "--no-first-run",
    "--no-default-browser-check",
    "--disable-gpu",
    "--disable-extensions",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--mute-audio",
    "--hide-scrollbars=false",
)

PLACE_FDS = """\
import fcntl, os, sys
given = int(sys.argv[1]), int(sys.argv[2])
high = [fcntl.fcntl(fd, fcntl.F_DUPFD, 10) for fd in given]  # the given fds may be 3 or 4
for fd in given:
    os.close(fd)
os.dup2(high[0], 3)
os.dup2(high[1], 4)
for fd in high:
    os.close(fd)
os.execvp(sys.argv[3], sys.argv[3:])
"""


class BrowserError(RuntimeError):
    """Chromium answered a command with an error, exited, or did not answer in time."""


class Browser:
    def __init__(self, program: str, timeout: float = 30.0) -> None:
        self.timeout = timeout
        self._profile = tempfile.TemporaryDirectory(prefix="dflash-chromium-")
        to_child_r, self._to_child = os.pipe()
        self._from_child, from_child_w = os.pipe()
        self._log = open(Path(self._profile.name) / "chromium.log", "wb")  # noqa: SIM115
        flags = [*FLAGS, f"--user-data-dir={self._profile.name}"]
        if os.geteuid() == 0:
            flags.append("--no-sandbox")  # Chromium refuses to run as root with its sandbox
        # A small Python moves the two pipe ends to fds 3 and 4, where Chromium expects them, and
        # executes it (sh cannot name fds above 9, and preexec_fn is unsafe with threads).
        fds = [str(to_child_r), str(from_child_w)]
        self._proc = subprocess.Popen(
            [sys.executable, "-c", PLACE_FDS, *fds, program, *flags, "about:blank"],
            pass_fds=(to_child_r, from_child_w),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=self._log,
        )
        os.close(to_child_r)
        os.close(from_child_w)
        self._buffer = b""
        self._next_id = 0
        self._events: list[dict[str, Any]] = []
        self._session = ""
        try:
            target = self.send("Target.createTarget", {"url": "about:blank"})["targetId"]
            attached = self.send("Target.attachToTarget", {"targetId": target, "flatten": True})
            self._session = attached["sessionId"]
            self.send("Page.enable", session=True)
        except BaseException:
            self.close()
            raise

    def send(
        self, method: str, params: dict[str, Any] | None = None, *, session: bool = False
    ) -> dict[str, Any]:
        """Send one command and wait for its answer (events read meanwhile are kept)."""
        self._next_id += 1
        message: dict[str, Any] = {"id": self._next_id, "method": method, "params": params or {}}
        if session:
            message["sessionId"] = self._session
        os.write(self._to_child, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + self.timeout
        while True:
            answer = self._read(deadline, f"{method}")
            if answer.get("id") == self._next_id:
                if "error" in answer:
                    raise BrowserError(f"{method}: {answer['error']}")
                result: dict[str, Any] = answer.get("result", {})
                return result
            if "method" in answer:
                self._events.append(answer)

    def set_viewport(self, width: int, height: int) -> None:
        self.send(
            "Emulation.setDeviceMetricsOverride",
            {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False},
            session=True,
        )

    def load(self, url: str) -> None:
        """Navigate the tab to ``url`` and wait for its load event (images included)."""
        self._events.clear()
        answer = self.send("Page.navigate", {"url": url}, session=True)
        if answer.get("errorText"):
            raise BrowserError(f"{url}: {answer['errorText']}")
        deadline = time.monotonic() + self.timeout
        while not any(e["method"] == "Page.loadEventFired" for e in self._events):
            self._events.append(self._read(deadline, f"load of {url}"))

    def evaluate(self, expression: str) -> Any:
        """The value of ``expression`` in the page (a promise is awaited), as JSON gives it."""
        answer = self.send(
            "Runtime.evaluate",
            {"expression": expression, "returnByValue": True, "awaitPromise": True},
            session=True,
        )
        if "exceptionDetails" in answer:
            raise BrowserError(f"script failed: {answer['exceptionDetails']}")
        return answer["result"].get("value")

    def close(self) -> None:
        with contextlib.suppress(BrowserError, OSError):
            self.send("Browser.close")
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        os.close(self._to_child)
        os.close(self._from_child)
        self._log.close()
        self._profile.cleanup()

    def _read(self, deadline: float, waiting_for: str) -> dict[str, Any]:
        while b"\0" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                raise BrowserError(f"no answer from Chromium in {self.timeout} s ({waiting_for})")
            ready, _, _ = select.select([self._from_child], [], [], left)
            if not ready:
                continue
            chunk = os.read(self._from_child, 1 << 16)
            if not chunk:
                err = (Path(self._profile.name) / "chromium.log").read_text(errors="replace")
                raise BrowserError(f"Chromium exited ({waiting_for}): {err[-2000:]}")
            self._buffer += chunk
        message, _, self._buffer = self._buffer.partition(b"\0")
        parsed: dict[str, Any] = json.loads(message)
        return parsed


def page_url(path: Path) -> str:
    return path.resolve().as_uri()
