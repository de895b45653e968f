"""The command blocks of the pages a newcomer follows, and how each is checked.

A fenced block in ``bash``/``sh``/``console`` (or ``python``) is a command block. By default it is
run as written on a fresh clone. An HTML comment on the line above it says otherwise:

    <!-- commands: server -->          a server: started in the background, the blocks after it on
                                       the page run against it; stopped (Ctrl-C) at the page's end
    <!-- commands: long REASON -->     too long to run in a test (a benchmark, the test suite):
                                       each line is checked without running it (``make -n``, or the
                                       command with ``--help``)
    <!-- commands: cluster REASON -->  needs a Kubernetes cluster or real workers: not run
    <!-- commands: gpu REASON -->      needs a GPU: not run
    <!-- commands: client TEST -->     needs a third-party client (Claude Code, Codex, aider): not
                                       run here; TEST (a file under tests/) runs it with these
                                       settings, or REASON says why nothing does
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGES = (
    "README.md",
    "docs/index.md",
    "docs/getting-started.md",
    "docs/agents.md",
    "docs/benchmarks.md",
)
SHELLS = ("bash", "sh", "shell", "console")
LANGUAGES = (*SHELLS, "python")
MODES = ("run", "server", "long", "cluster", "gpu", "client")
MARK = re.compile(r"^<!--\s*commands:\s*(\w+)\s*(.*?)\s*-->\s*$")
FENCE = re.compile(r"^(\s*)```\s*([\w+-]*)")


@dataclass(frozen=True)
class Block:
    page: str
    line: int  # of the opening fence, 1-based
    language: str
    text: str
    mode: str
    reason: str

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def blocks(page: str) -> list[Block]:
    """Every fenced block of ``page`` (relative to the repository), commands or not."""
    found: list[Block] = []
    lines = (ROOT / page).read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        indent, language = opening.groups()
        end = i + 1
        while end < len(lines) and not lines[end].strip().startswith("```"):
            end += 1
        body = "\n".join(line.removeprefix(indent) for line in lines[i + 1 : end])
        mark = MARK.match(lines[i - 1].strip()) if i > 0 else None
        mode, reason = mark.groups() if mark else ("run", "")
        found.append(Block(page, i + 1, language.lower(), body + "\n", mode, reason))
        i = end + 1
    return found


def command_blocks() -> list[Block]:
    return [b for page in PAGES for b in blocks(page) if b.language in LANGUAGES]


def commands(text: str) -> list[str]:
    """The block's commands: lines joined at a trailing backslash, comments and blanks left out."""
    out: list[str] = []
    current = ""
    for raw in text.splitlines():
        line = raw.rstrip()
        if not current and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.endswith("\\"):
            current += line[:-1] + " "
            continue
        out.append(current + line)
        current = ""
    if current:
        out.append(current)
    return out
