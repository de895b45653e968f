"""``python -m loadtest.affinity``: prefix-cache hit rate under each routing policy.

Multi-turn conversations (a shared system prompt, then turns that each resend the whole history,
as chat clients do) go through the gateway in front of three emulated workers. Each emulator
models SGLang's radix cache: a prompt whose prefix it has seen reports ``cached_tokens``. The hit
rate is Σ cached_tokens / Σ prompt_tokens over all workers, from the emulators' ground truth,
with the per-worker request spread beside it (affinity must not pile everything on one node).

    make bench-affinity
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from pathlib import Path
from typing import Any

import httpx

from loadtest.processes import PYTHON, ManagedProcess, ProcessManager

SYSTEM = (
    "You are a meticulous assistant for a team of engineers. Answer with precise, verifiable "
    "statements, show intermediate steps for calculations, and keep a neutral tone. "
) * 6


async def conversation(client: httpx.AsyncClient, index: int, turns: int) -> None:
    messages: list[dict[str, str]] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"Conversation {index}: plan a migration of service {index}."},
    ]
    for turn in range(turns):
        body = {
            "model": "kimi-k2.5",
            "messages": messages,
            "max_tokens": 48,
            "chat_template_kwargs": {"thinking": False},
        }
        response = await client.post("/v1/chat/completions", json=body)
        response.raise_for_status()
        reply = response.json()["choices"][0]["message"]["content"] or "..."
        messages += [
            {"role": "assistant", "content": reply},
            {"role": "user", "content": f"Turn {turn + 1}: go on with the next step."},
        ]


async def drive(url: str, conversations: int, turns: int, concurrency: int) -> None:
    limit = asyncio.Semaphore(concurrency)

    async def one(i: int) -> None:
        async with limit:
            await conversation(client, i, turns)

    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        await asyncio.gather(*(one(i) for i in range(conversations)))


def measure(policy: str, args: argparse.Namespace, logs: Path) -> dict[str, Any]:
    procs = ProcessManager(logs)
    try:
        emulators: list[ManagedProcess] = [
            procs.start(
                [PYTHON, "-m", "app", "emulate", "--port", "{port}", "--speed", "50"],
                name=f"emulator-{policy}-{i}",
            )
            for i in range(args.workers)
        ]
        argv = [PYTHON, "-m", "app", "serve", "--port", "{port}", "--policy", policy]
        for emulator in emulators:
            argv += ["--worker-url", emulator.url]
        gateway = procs.start(
            argv,
            name=f"gateway-{policy}",
            ready_path="/readyz",
            ready_status=200,
            env={"DFLASH_GATEWAY_LOG_LEVEL": "warning"},
        )
        asyncio.run(drive(gateway.url, args.conversations, args.turns, args.concurrency))
        totals = [
            httpx.get(e.url + "/emulator/stats", params={"limit": 0}).json()["totals"]
            for e in emulators
        ]
    finally:
        procs.stop_all()
    prompt = sum(t["prompt_tokens"] for t in totals)
    cached = sum(t["cached_tokens"] for t in totals)
    return {
        "policy": policy,
        "hit_rate": cached / prompt if prompt else 0.0,
        "spread": [t["requests"] for t in totals],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policies", default="prefix_affinity,least_inflight,round_robin")
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--conversations", type=int, default=48)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=12)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="dflash-affinity-") as tmp:
        rows = [measure(p.strip(), args, Path(tmp)) for p in args.policies.split(",")]
    print(f"{'policy':<16} {'cache hit rate':>14}   requests per worker")
    for row in rows:
        print(f"{row['policy']:<16} {row['hit_rate']:>14.1%}   {row['spread']}")
    print(
        f"({args.conversations} conversations x {args.turns} turns, C={args.concurrency}, "
        f"{args.workers} emulated workers; hit rate = cached / prompt tokens, emulator truth)"
    )


if __name__ == "__main__":
    main()
