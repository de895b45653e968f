"""CPU per request of the HTTP clients the gateway could use for its proxied POST, side by side:

    .venv/bin/python -m loadtest.client_cost [--requests 2000] [--concurrency 32] [--rounds 3]

One emulator in ``--replay`` mode (pre-rendered chunks) on one CPU; each client runs in its own
process on the other CPU (uvloop, like the gateway) and POSTs ``--requests`` chat completions at
``--concurrency``, reading every body to its end the way the relay does (raw reads, no
decoding). Reported: that process's CPU (utime+stime) per request, for streamed responses of
``--tokens`` tokens and for non-streamed ones; best and worst of ``--rounds``. Clients:

- ``httpx``: ``httpx.AsyncClient`` (httpcore's HTTP/1.1 pool);
- ``aiohttp``: ``aiohttp.ClientSession`` (when installed; not a gateway dependency);
- ``http1``: ``app.upstream.http1`` (asyncio Protocol + httptools), the gateway's choice.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import orjson

from loadtest.processes import PYTHON, ProcessManager

MODEL = "moonshotai/Kimi-K2.5"
CLIENTS = ("httpx", "aiohttp", "http1")


def _body(stream: bool, tokens: int) -> bytes:
    return orjson.dumps(
        {
            "model": MODEL,
            "stream": stream,
            "max_tokens": tokens,
            "messages": [{"role": "user", "content": "hi"}],
        }
    )


async def _run_http1(url: str, body: bytes, n: int, concurrency: int) -> int:
    from app.config import Settings
    from app.upstream.client import UpstreamClient
    from app.workers.worker import Worker

    client = UpstreamClient(Settings())
    worker = Worker(url)

    async def one() -> int:
        response = await client.open(worker, "/v1/chat/completions", body, [])
        size = 0
        async for part in response.aiter_raw():
            size += len(part)
        await response.aclose()
        return size

    try:
        return await _drive(one, n, concurrency)
    finally:
        await client.aclose()


async def _run_httpx(url: str, body: bytes, n: int, concurrency: int) -> int:
    import httpx

    limits = httpx.Limits(max_connections=None, keepalive_expiry=4.0)
    headers = {"content-type": "application/json", "accept-encoding": "identity"}
    async with httpx.AsyncClient(limits=limits, timeout=None, trust_env=False) as client:

        async def one() -> int:
            size = 0
            async with client.stream(
                "POST", url + "/v1/chat/completions", content=body, headers=headers
            ) as r:
                async for part in r.aiter_raw():
                    size += len(part)
            return size

        return await _drive(one, n, concurrency)


async def _run_aiohttp(url: str, body: bytes, n: int, concurrency: int) -> int:
    import aiohttp

    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=4.0)
    headers = {"content-type": "application/json", "accept-encoding": "identity"}
    async with aiohttp.ClientSession(connector=connector, auto_decompress=False) as session:

        async def one() -> int:
            size = 0
            async with session.post(url + "/v1/chat/completions", data=body, headers=headers) as r:
                async for part in r.content.iter_any():
                    size += len(part)
            return size

        return await _drive(one, n, concurrency)


async def _drive(one: Callable[[], Awaitable[int]], n: int, concurrency: int) -> int:
    todo = iter(range(n))
    total = 0

    async def loop() -> None:
        nonlocal total
        for _ in todo:
            size = await one()  # not ``total += await one()``: that reads total before awaiting
            total += size

    await asyncio.gather(*(loop() for _ in range(concurrency)))
    return total


RUNNERS: dict[str, Callable[[str, bytes, int, int], Awaitable[int]]] = {
    "httpx": _run_httpx,
    "aiohttp": _run_aiohttp,
    "http1": _run_http1,
}


def _child(argv: list[str]) -> int:
    """In the client's own process: warm up, then measure this process's CPU."""
    import uvloop

    name, url, stream, tokens, n, concurrency = argv
    body = _body(stream == "1", int(tokens))
    runner = RUNNERS[name]

    async def main() -> dict[str, Any]:
        await runner(url, body, max(64, int(concurrency) * 2), int(concurrency))
        before = os.times()
        start = time.perf_counter()
        size = await runner(url, body, int(n), int(concurrency))
        after = os.times()
        cpu = (after.user - before.user) + (after.system - before.system)
        return {"cpu_s": cpu, "wall_s": time.perf_counter() - start, "bytes": size}

    print(json.dumps(uvloop.run(main())))
    return 0


def _available(name: str) -> bool:
    if name != "aiohttp":
        return True
    try:
        import aiohttp  # noqa: F401
    except ImportError:
        return False
    return True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--clients", default=",".join(CLIENTS))
    p.add_argument("--child", nargs=6, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return _child(args.child)
    names = [c for c in args.clients.split(",") if c and _available(c)]
    results: dict[tuple[str, bool], list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="client-cost-") as tmp:
        procs = ProcessManager(Path(tmp))
        try:
            emu = procs.start(
                ["taskset", "-c", "1", PYTHON, "-m", "app", "emulate", "--port", "{port}",
                 "--replay", "--replay-tokens", str(args.tokens),
                 "--max-running-requests", "4096"],
                name="emulator",
            )  # fmt: skip
            for _ in range(args.rounds):
                for stream in (True, False):
                    for name in names:
                        out = subprocess.run(
                            ["taskset", "-c", "0", PYTHON, "-m", "loadtest.client_cost",
                             "--child", name, emu.url, "1" if stream else "0",
                             str(args.tokens), str(args.requests), str(args.concurrency)],
                            check=True, capture_output=True, text=True,
                        )  # fmt: skip
                        got = json.loads(out.stdout.strip().splitlines()[-1])
                        results.setdefault((name, stream), []).append(got["cpu_s"])
        finally:
            procs.stop_all()
    print(f"client CPU per request, {args.requests} requests at C={args.concurrency} "
          f"({args.rounds} rounds: best-worst)")  # fmt: skip
    for stream in (True, False):
        kind = f"stream {args.tokens} tok" if stream else "non-stream"
        for name in names:
            cpu = sorted(results[(name, stream)])
            lo, hi = cpu[0] / args.requests * 1e3, cpu[-1] / args.requests * 1e3
            print(f"  {kind:<16} {name:<8} {lo:.3f}-{hi:.3f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
