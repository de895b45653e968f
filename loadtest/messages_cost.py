"""What the Messages stream translator costs per worker chunk, in process, against chat's relay
observer (and, with ``--against``, another version of the translator), interleaved in one run:

    .venv/bin/python -m loadtest.messages_cost [--against OLD_STREAM_PY] [--rounds 5]

One replayed 256-token worker stream (the emulator's renderer: a role chunk, 100 reasoning and
156 text deltas, finish, usage, ``[DONE]``) is fed whole, as at saturation, to a fresh
translator ``--repeat`` times per round; each round measures every translator in turn
(process CPU time). Printed: the median µs per worker chunk and per stream, and the ratios.
``--against`` takes a file holding an older ``app/anthropic/stream.py`` (for example
``git show COMMIT:app/anthropic/stream.py > /tmp/old.py``).
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import time
from collections.abc import Callable
from typing import Any

from app.anthropic.stream import MessagesStream
from app.emulator import render
from app.upstream.sse import SSEObserver


def worker_stream() -> list[bytes]:
    chunks = render.ChatChunks("abc123", 1, "moonshotai/Kimi-K2.5", tools_active=False)
    parts = [chunks.role()]
    parts += [chunks.reasoning(f"tok{i} ") for i in range(100)]
    parts += [chunks.content(f"word{i} ") for i in range(156)]
    usage = chunks.usage(render.usage(120, 256, 100, None))
    return [*parts, chunks.finish("stop", 163586), usage, render.DONE]


def _older(path: str) -> Callable[[], Any]:
    spec = importlib.util.spec_from_file_location("older_messages_stream", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return lambda: module.MessagesStream("kimi")


def _cost(make: Callable[[], Any], raw: bytes, repeat: int) -> float:
    start = time.process_time()
    for _ in range(repeat):
        translator = make()
        translator.feed(raw)
        translator.finish()
    return (time.process_time() - start) / repeat


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--against", help="a file holding an older app/anthropic/stream.py")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--repeat", type=int, default=200, help="streams per translator per round")
    args = p.parse_args()
    parts = worker_stream()
    raw = b"".join(parts)
    makers: dict[str, Callable[[], Any]] = {
        "messages": lambda: MessagesStream("kimi"),
        "chat": lambda: SSEObserver(drop_usage=False, overhead=2),
    }
    if args.against:
        makers["messages-older"] = _older(args.against)
    runs: dict[str, list[float]] = {name: [] for name in makers}
    for _ in range(args.rounds):
        for name, make in makers.items():
            runs[name].append(_cost(make, raw, args.repeat))
    median = {name: statistics.median(values) for name, values in runs.items()}
    for name, seconds in median.items():
        print(
            f"{name:15} {seconds / len(parts) * 1e6:6.2f} µs/chunk {seconds * 1e6:8.0f} µs/stream"
        )
    print(f"messages / chat: {median['messages'] / median['chat']:.2f}x")
    if args.against:
        print(f"messages / messages-older: {median['messages'] / median['messages-older']:.2f}x")


if __name__ == "__main__":
    main()
