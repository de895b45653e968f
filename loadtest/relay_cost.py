"""Split the gateway's CPU into a per-request and a per-relayed-chunk part, and measure its added
TTFT against the worker directly. A quick local check for the relay hot path:

    .venv/bin/python -m loadtest.relay_cost [--requests 400] [--concurrency 32]

One emulator in ``--replay`` mode (pre-rendered chunks, no generation work) and one gateway, both
real processes. Streams of two lengths (64 and 2048 replayed tokens) go through the gateway at
``--concurrency``; the gateway process's utime+stime per request is fitted as
``per_request + chunks_per_request * per_chunk`` from the two lengths. Then ``--sequential``
streams, one at a time, measure time to the first ``data:`` event directly and through the
gateway (p50/p99; added = gateway - direct).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time
from pathlib import Path

import httpx

from loadtest.processes import PYTHON, ProcessManager
from loadtest.stats import percentile

MODEL = "moonshotai/Kimi-K2.5"


def cpu_seconds(pid: int) -> float:
    raw = Path(f"/proc/{pid}/stat").read_text()
    fields = raw[raw.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def body(tokens: int) -> dict[str, object]:
    return {
        "model": MODEL,
        "stream": True,
        "max_tokens": tokens,
        "messages": [{"role": "user", "content": "hi"}],
    }


async def stream(client: httpx.AsyncClient, url: str, tokens: int) -> tuple[float, int]:
    """(seconds to the first data event, data events) for one streamed request."""
    start = time.perf_counter()
    first = 0.0
    events = 0
    async with client.stream("POST", url + "/v1/chat/completions", json=body(tokens)) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                if not events:
                    first = time.perf_counter() - start
                events += 1
    return first, events


async def concurrent(url: str, tokens: int, requests: int, concurrency: int) -> int:
    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        gate = asyncio.Semaphore(concurrency)

        async def one() -> int:
            async with gate:
                return (await stream(client, url, tokens))[1]

        return sum(await asyncio.gather(*(one() for _ in range(requests))))


async def sequential(url: str, requests: int) -> list[float]:
    async with httpx.AsyncClient(timeout=120) as client:
        for _ in range(10):
            await stream(client, url, 64)
        return sorted([(await stream(client, url, 64))[0] for _ in range(requests)])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--requests", type=int, default=400, help="streams per length")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--sequential", type=int, default=300, help="streams for the TTFT run")
    args = p.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="relay-cost-") as tmp:
        procs = ProcessManager(Path(tmp))
        try:
            per_request: dict[int, tuple[float, float]] = {}
            for tokens in (64, 2048):
                emu = procs.start(
                    [PYTHON, "-m", "app", "emulate", "--port", "{port}", "--replay",
                     "--replay-tokens", str(tokens), "--max-running-requests", "4096"],
                    name=f"emulator-{tokens}",
                )  # fmt: skip
                gw = procs.start(
                    [PYTHON, "-m", "app", "serve", "--port", "{port}", "--worker-url", emu.url],
                    name=f"gateway-{tokens}",
                    ready_path="/readyz",
                    ready_status=200,
                    env={"DFLASH_GATEWAY_LOG_LEVEL": "warning"},
                )
                asyncio.run(concurrent(gw.url, tokens, args.concurrency * 2, args.concurrency))
                before = cpu_seconds(gw.pid)
                events = asyncio.run(concurrent(gw.url, tokens, args.requests, args.concurrency))
                used = cpu_seconds(gw.pid) - before
                per_request[tokens] = (used / args.requests, events / args.requests)
                per_stream_ms = used / args.requests * 1e3
                print(
                    f"{tokens:>5} tokens: {events / args.requests:6.1f} events/stream, gateway CPU "
                    f"{per_stream_ms:.2f} ms/stream, {used / events * 1e6:.1f} us/event"
                )
                if tokens == 64:
                    direct = asyncio.run(sequential(emu.url, args.sequential))
                    via = asyncio.run(sequential(gw.url, args.sequential))
                gw.stop()
                emu.stop()
            (short_cpu, short_n), (long_cpu, long_n) = per_request[64], per_request[2048]
            chunk = (long_cpu - short_cpu) / (long_n - short_n)
            fixed = short_cpu - short_n * chunk
            print(f"fit: {chunk * 1e6:.1f} us CPU per relayed chunk + {fixed * 1e3:.2f} ms/stream")
            d50, d99 = percentile(direct, 50), percentile(direct, 99)
            v50, v99 = percentile(via, 50), percentile(via, 99)
            print(
                f"TTFT C=1 ({args.sequential} streams): direct p50 {d50 * 1e3:.2f} ms "
                f"p99 {d99 * 1e3:.2f} ms; via gateway p50 {v50 * 1e3:.2f} ms p99 {v99 * 1e3:.2f} "
                f"ms; added p50 {(v50 - d50) * 1e3:.2f} ms, p99 {(v99 - d99) * 1e3:.2f} ms"
            )
        finally:
            procs.stop_all()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
