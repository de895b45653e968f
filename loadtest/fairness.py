"""``bench fairness``: one tenant floods, another sends a few at a time; who waits?

A gateway and one emulated worker as real processes. The worker and the gateway's admission cap
are ``--slots`` (16) requests, so the gateway's admission queue holds the rest. Two API keys,
tenant A and tenant B, with the same policy (weight 1, class normal). In one run:

1. baseline: B alone sends ``--b-concurrency`` (4) streams at a time, ``--baseline-requests`` in
   all;
2. flood: A keeps ``--a-streams`` (150) streams open (each one ended is replaced at once), which
   fills every slot and queues the rest; once A's queue has formed, B sends its 4 at a time again
   for ``--duration`` seconds. A's requests sent in that window are measured.

Per tenant and phase: requests, queue wait p50/p99 (the gateway's own figure, ``queue_ms`` of its
access log) and TTFT p50/p99 (the client's: first content chunk). The goals checked:

- B never waits behind A's queue: B's queue wait p50 at most the time for one slot to free,
  mean slot hold time (stream duration less queue wait, over the flood's requests) / slots;
- B's TTFT p50 under the flood at most 0.2 x A's;
- A still gets every slot B leaves: the worker's slots busy on average during the window
  (sampled from the gateway's ``/workers``) at least 95 % of them.

Streams ask for 0.5-1.5 x ``--max-tokens`` (64) tokens without reasoning, profile gsm8k (lengths
spread so that slots free one at a time, not in lockstep); the emulator runs at ``--speed`` (1.0:
a real node's pace). Prints the table and writes ``fairness.json`` to
``--out`` (loadtest/results/).

    make bench-fairness
    python -m loadtest fairness --a-streams 60 --slots 8 --duration 10   # a shorter run
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import random
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
import orjson

from loadtest.processes import PYTHON, ManagedProcess, ProcessManager
from loadtest.stats import summarize

ROWS = (("A", "flood", "A (flood)"), ("B", "flood", "B (under flood)"), ("B", "alone", "B alone"))
KEYS = {"A": "tenant-a-key-0123456789abcdef", "B": "tenant-b-key-0123456789abcdef"}


@dataclass
class Sample:
    tenant: str
    phase: str  # "alone" | "flood"
    request_id: str
    sent: float  # perf_counter
    ok: bool = False
    ttft_s: float | None = None
    e2e_s: float = 0.0
    queue_s: float | None = None  # from the gateway's access log
    error: str | None = None


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--slots", type=int, default=16, help="the worker's running cap")
    p.add_argument("--a-streams", type=int, default=150, help="tenant A's concurrent streams")
    p.add_argument("--b-concurrency", type=int, default=4, help="tenant B's streams at a time")
    p.add_argument("--baseline-requests", type=int, default=40, help="B's requests alone")
    p.add_argument("--duration", type=float, default=20.0, help="seconds B runs under the flood")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--speed", type=float, default=1.0, help="the emulator's time scale")
    p.add_argument("--out", type=Path, default=Path("loadtest/results"))


class Client:
    """Streams for one run: every request gets its own X-Request-Id (joined with the access log
    afterwards)."""

    def __init__(self, client: httpx.AsyncClient, max_tokens: int) -> None:
        self._client = client
        self._ids = itertools.count()
        self._rng = random.Random(0)
        # Lengths spread over 0.5-1.5 x max_tokens: streams that all lasted as long would end
        # in lockstep, freeing the slots in bursts instead of one at a time.
        self._bodies = [
            orjson.dumps(
                {
                    "model": "kimi-k2.5",
                    "messages": [{"role": "user", "content": f"Solve: 17 * {23 + i} = ?"}],
                    "max_tokens": max(1, round(max_tokens * (0.5 + i / 10))),
                    "stream": True,
                    "chat_template_kwargs": {"thinking": False},
                }
            )
            for i in range(11)
        ]
        self.samples: list[Sample] = []

    async def stream(self, tenant: str, phase: str) -> Sample:
        sample = Sample(tenant, phase, f"{tenant}-{phase}-{next(self._ids)}", time.perf_counter())
        headers = {
            "Authorization": f"Bearer {KEYS[tenant]}",
            "Content-Type": "application/json",
            "X-Request-Id": sample.request_id,
            "X-Emulator-Profile": "gsm8k",
        }
        try:
            async with self._client.stream(
                "POST",
                "/v1/chat/completions",
                content=self._rng.choice(self._bodies),
                headers=headers,
            ) as response:
                if response.status_code != 200:
                    sample.error = f"HTTP {response.status_code}"
                else:
                    async for line in response.aiter_lines():
                        if sample.ttft_s is None and '"content":"' in line and "role" not in line:
                            sample.ttft_s = time.perf_counter() - sample.sent
                        elif line == "data: [DONE]":
                            sample.ok = sample.ttft_s is not None
                            break
        except httpx.HTTPError as exc:
            sample.error = f"{type(exc).__name__}: {exc}"
        sample.e2e_s = time.perf_counter() - sample.sent
        self.samples.append(sample)
        return sample

    async def closed_loop(
        self, tenant: str, phase: Callable[[], str], width: int, until: Callable[[], bool]
    ) -> None:
        """``width`` streams at a time, each replaced when it ends, while ``until()`` is false;
        each labelled with ``phase()`` when sent."""

        async def lane() -> None:
            while not until():
                await self.stream(tenant, phase())

        await asyncio.gather(*(lane() for _ in range(width)))


async def drive(gateway_url: str, args: argparse.Namespace) -> tuple[list[Sample], float]:
    """Both phases; returns the measured samples and the mean busy share of the slots while B
    ran under the flood."""
    limits = httpx.Limits(max_connections=args.a_streams + args.b_concurrency + 8)
    async with httpx.AsyncClient(
        base_url=gateway_url, limits=limits, timeout=httpx.Timeout(600, connect=10)
    ) as http:
        client = Client(http, args.max_tokens)
        left = itertools.count(args.baseline_requests, -1)
        await client.closed_loop("B", lambda: "alone", args.b_concurrency, lambda: next(left) <= 0)
        a_phase = "warmup"  # A's requests sent before B starts are not measured
        a_stop = asyncio.Event()
        flood = asyncio.ensure_future(
            client.closed_loop("A", lambda: a_phase, args.a_streams, a_stop.is_set)
        )
        threshold = max(1, args.a_streams - 2 * args.slots)
        ops = {"authorization": f"Bearer {KEYS['A']}"}  # /workers needs a key, as keys are set
        while (await http.get("/workers", headers=ops)).json()["queued"] < threshold:  # noqa: ASYNC110
            await asyncio.sleep(0.1)  # polls the gateway
        a_phase = "flood"
        window_end = time.perf_counter() + args.duration
        busy: list[float] = []

        async def sample_busy() -> None:
            while time.perf_counter() < window_end:
                table = (await http.get("/workers", headers=ops)).json()["workers"]
                busy.append(sum(w["in_flight"] for w in table) / args.slots)
                await asyncio.sleep(0.25)

        sampler = asyncio.ensure_future(sample_busy())
        await client.closed_loop(
            "B", lambda: "flood", args.b_concurrency, lambda: time.perf_counter() >= window_end
        )
        a_stop.set()
        await asyncio.gather(flood, sampler)
        utilisation = sum(busy) / len(busy) if busy else math.nan
        return [s for s in client.samples if s.phase != "warmup"], utilisation


def queue_waits(log_text: str) -> dict[str, float | None] | None:
    """Queue wait by the X-Request-Id each request was sent with (the access line's
    ``client_request_id``; the line's own ``request_id`` is the gateway's) from the gateway's
    JSON access log (None when this gateway does not log queue waits)."""
    waits: dict[str, float | None] = {}
    logged = False
    for line in log_text.splitlines():
        if not line.startswith("{") or '"dflash_gateway.access"' not in line:
            continue
        doc = json.loads(line)
        logged = logged or "queue_ms" in doc
        waits[doc.get("client_request_id") or doc["request_id"]] = doc.get("queue_ms", 0.0) / 1000
    return waits if logged else None


def _ms(value: float) -> float:
    return round(value * 1000, 1)


def rows(samples: list[Sample]) -> list[dict[str, Any]]:
    out = []
    for tenant, phase, label in ROWS:
        mine = [s for s in samples if s.tenant == tenant and s.phase == phase]
        ok = [s for s in mine if s.ok]
        ttft = summarize([s.ttft_s for s in ok if s.ttft_s is not None])
        waits = [s.queue_s for s in ok if s.queue_s is not None]
        wait = summarize(waits)
        out.append(
            {
                "tenant": label,
                "requests": len(ok),
                "failed": len(mine) - len(ok),
                "queue_wait_p50_ms": _ms(wait.median) if waits else None,
                "queue_wait_p99_ms": _ms(wait.p99) if waits else None,
                "ttft_p50_ms": _ms(ttft.median),
                "ttft_p99_ms": _ms(ttft.p99),
            }
        )
    return out


def table(lines: list[dict[str, Any]]) -> str:
    header = (
        f"{'tenant':<16} {'requests':>8} {'queue wait p50':>14} {'p99':>9} "
        f"{'TTFT p50':>9} {'p99':>9}"
    )

    def ms(value: float | None) -> str:
        return "n/a" if value is None or math.isnan(value) else f"{value:.0f}ms"

    out = [header, "-" * len(header)]
    for r in lines:
        out.append(
            f"{r['tenant']:<16} {r['requests']:>8} {ms(r['queue_wait_p50_ms']):>14} "
            f"{ms(r['queue_wait_p99_ms']):>9} {ms(r['ttft_p50_ms']):>9} {ms(r['ttft_p99_ms']):>9}"
        )
    return "\n".join(out)


def goals(
    lines: list[dict[str, Any]],
    samples: list[Sample],
    args: argparse.Namespace,
    utilisation: float,
) -> dict[str, Any]:
    by = {r["tenant"]: r for r in lines}
    a, b = by["A (flood)"], by["B (under flood)"]
    held = [s.e2e_s - (s.queue_s or 0.0) for s in samples if s.phase == "flood" and s.ok]
    slot_free_ms = _ms(sum(held) / len(held) / args.slots) if held else math.nan
    b_wait = b["queue_wait_p50_ms"]
    ratio = b["ttft_p50_ms"] / a["ttft_p50_ms"] if a["ttft_p50_ms"] else math.nan
    return {
        "one_slot_free_ms": slot_free_ms,
        "b_wait_within_one_slot": None if b_wait is None else b_wait <= slot_free_ms,
        "b_ttft_ratio": round(ratio, 3),
        "b_ttft_at_most_0.2x_a": ratio <= 0.2,
        "slots_busy_share": round(utilisation, 3),
        "a_takes_the_slots_b_leaves": utilisation >= 0.95,
    }


def measure(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="dflash-fairness-") as tmp:
        procs = ProcessManager(Path(tmp))
        try:
            emulator = procs.start(
                [
                    *(PYTHON, "-m", "app", "emulate", "--port", "{port}"),
                    *("--speed", str(args.speed), "--max-running-requests", str(args.slots)),
                ],
                name="emulator",
            )
            gateway: ManagedProcess = procs.start(
                [PYTHON, "-m", "app", "serve", "--port", "{port}", "--worker-url", emulator.url],
                name="gateway",
                ready_path="/readyz",
                ready_status=200,
                env={
                    "DFLASH_GATEWAY_API_KEYS": ",".join(f"{t}:{k}" for t, k in KEYS.items()),
                    "DFLASH_GATEWAY_ADMISSION__PER_WORKER_CAP": str(args.slots),
                    "DFLASH_GATEWAY_ADMISSION__QUEUE_SIZE": str(args.a_streams * 4),
                    "DFLASH_GATEWAY_ADMISSION__QUEUE_TIMEOUT_S": "600",
                    "DFLASH_GATEWAY_LOG_JSON": "true",
                    "DFLASH_GATEWAY_LOG_LEVEL": "info",
                },
            )
            samples, utilisation = asyncio.run(drive(gateway.url, args))
            log_text = gateway.logs()
        finally:
            procs.stop_all()
    waits = queue_waits(log_text)
    for sample in samples:
        if waits is not None:
            sample.queue_s = waits.get(sample.request_id)
    lines = rows(samples)
    return {
        "rows": lines,
        "goals": goals(lines, samples, args, utilisation),
        "samples": [asdict(s) for s in samples],
    }


def main(args: argparse.Namespace) -> int:
    started = time.time()
    result = measure(args)
    print(table(result["rows"]))
    g = result["goals"]
    print(
        f"\none slot frees every {g['one_slot_free_ms']:.0f} ms (mean slot hold / {args.slots});"
        f" B's queue wait p50 within it: {g['b_wait_within_one_slot']}\n"
        f"B's TTFT p50 / A's: {g['b_ttft_ratio']:.3f} (goal <= 0.2: "
        f"{g['b_ttft_at_most_0.2x_a']})\n"
        f"slots busy under the flood: {g['slots_busy_share']:.1%} (A takes what B leaves: "
        f"{g['a_takes_the_slots_b_leaves']})"
    )
    meta = {
        **{k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "started_unix": round(started, 3),
        "duration_s": round(time.time() - started, 3),
    }
    meta.pop("bench", None)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "fairness.json"
    path.write_text(json.dumps({"meta": meta, **result}, indent=2) + "\n")
    print(f"\nwrote {path}")
    failed = sum(r["failed"] for r in result["rows"])
    return 0 if not failed else 1
