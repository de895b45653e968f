"""``bench routing``: every routing policy on a heterogeneous and a homogeneous fleet.

Four emulated workers behind the gateway, fresh processes for every (fleet, policy) run:

- heterogeneous: one slower node (``--step-time-scale 2``: every verify step and prefill twice as
  long), one whose drafter no longer matches its target (``--accept-scale 0.28``: acceptance
  ~1.3 instead of ~4.5), two normal;
- homogeneous: four normal workers (any policy should do as well as ``least_inflight`` here).

A closed loop of ``--concurrency`` streams (128) sends a mix of the seed's datasets (whatever of
GSM8K, MATH500, HumanEval, MBPP, MT-Bench is available locally, interleaved; the emulators pick
each prompt's acceptance profile from its content). Per run: fleet output tok/s (completion
tokens / wall time of the measured phase, the first C requests being warm-up), TTFT p50/p99 and
completed requests. The emulators run at ``--speed`` (default 0.5: half a real node's pace;
every tok/s scales with it): at C=128 that keeps the ~1000 SSE chunks/s of the gateway, the
client and four emulators within a 2-core machine, and a run of 1000 prompts to about two
minutes (12 runs: ~25 min for ``make bench-routing``); the gateway polls ``/v1/loads`` every
``--loads-interval-s`` (0.5 s). Writes ``routing.json`` and ``routing.png`` to ``--out``;
``--docs`` also publishes the plot and the results into ``docs/img/`` and prints the table for
``docs/benchmarks.md`` (``loadtest/figures.py``), and ``--replot FILE`` does the drawing and
publishing from a saved ``routing.json`` without running anything.

    make bench-routing
    make bench-routing DOCS=1
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from app.config import POLICY_NAMES
from loadtest import datasets, figures, runner
from loadtest.processes import PYTHON, ProcessManager
from loadtest.stats import summarize

FLEETS: dict[str, list[list[str]]] = {
    "heterogeneous": [[], [], ["--step-time-scale", "2"], ["--accept-scale", "0.28"]],
    "homogeneous": [[], [], [], []],
}
WORKER_LABELS: dict[str, list[str]] = {
    "heterogeneous": ["normal", "normal", "slow x2", "accept ~1.3"],
    "homogeneous": ["normal"] * 4,
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--policies", default=",".join(POLICY_NAMES), help="comma-separated")
    p.add_argument("--fleets", default=",".join(FLEETS), help="comma-separated subset")
    p.add_argument("--concurrency", type=int, default=128)
    p.add_argument(
        "--num-prompts", type=int, default=1000, help="requests per run, warm-up included"
    )
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--speed", type=float, default=0.5, help="the emulators' time scale")
    p.add_argument("--loads-interval-s", type=float, default=0.5)
    p.add_argument(
        "--datasets-dir",
        type=Path,
        default=None,
        help="holds gsm8k/ and mbpp/ (default ../shared/datasets next to the checkout)",
    )
    p.add_argument("--out", type=Path, default=Path("bench-results"))
    p.add_argument(
        "--docs",
        action="store_true",
        help="also write the plot and results to docs/img/ and print the page's table",
    )
    p.add_argument(
        "--replot",
        type=Path,
        metavar="ROUTING_JSON",
        help="run nothing: draw (and with --docs publish) a saved routing.json",
    )


def prompt_mix(datasets_dir: Path | None, count: int) -> tuple[list[str], list[str]]:
    """``count`` prompts taking turns over every available dataset, and the datasets used."""
    pools: list[list[str]] = []
    used: list[str] = []
    for name in datasets.DATASETS:
        try:
            pools.append(datasets.load(name, datasets_dir=datasets_dir).prompts)
            used.append(name)
        except datasets.DatasetUnavailable:
            continue
    if not pools:
        raise SystemExit("no dataset available: pass --datasets-dir (see loadtest/datasets.py)")
    prompts = [
        pools[i % len(pools)][(i // len(pools)) % len(pools[i % len(pools)])] for i in range(count)
    ]
    return prompts, used


def measure(
    fleet: str, policy: str, prompts: list[str], args: argparse.Namespace
) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="dflash-routing-") as tmp:
        procs = ProcessManager(Path(tmp))
        try:
            emulate = [
                PYTHON,
                "-m",
                "app",
                "emulate",
                "--port",
                "{port}",
                "--speed",
                str(args.speed),
            ]
            emulators = [
                procs.start([*emulate, "--seed", str(i), *extra], name=f"emulator-{i}")
                for i, extra in enumerate(FLEETS[fleet])
            ]
            argv = [PYTHON, "-m", "app", "serve", "--port", "{port}", "--policy", policy]
            for emulator in emulators:
                argv += ["--worker-url", emulator.url]
            gateway = procs.start(
                argv,
                name="gateway",
                ready_path="/readyz",
                ready_status=200,
                env={
                    "DFLASH_GATEWAY_LOG_LEVEL": "warning",
                    "DFLASH_GATEWAY_HEALTH__LOADS_INTERVAL_S": str(args.loads_interval_s),
                },
            )
            config = runner.RunConfig(
                base_url=gateway.url,
                model="kimi-k2.5",
                concurrency=args.concurrency,
                max_tokens=args.max_tokens,
                thinking=False,
                stream=True,
            )
            phase = asyncio.run(runner.run(config, prompts, runner.progress_bar(policy)))
            spread = [
                httpx.get(e.url + "/emulator/stats", params={"limit": 0}, timeout=10).json()[
                    "totals"
                ]["requests"]
                for e in emulators
            ]
        finally:
            procs.stop_all()
    ok = [r for r in phase.results if r.ok]
    ttft = summarize([r.ttft_s for r in ok if r.ttft_s is not None]).scaled(1000)
    return {
        "fleet": fleet,
        "policy": policy,
        "output_tok_s": round(phase.output_tok_s, 1),
        "ttft_p50_ms": round(ttft.median, 1),
        "ttft_p99_ms": round(ttft.p99, 1),
        "completed": len(ok),
        "failed": len(phase.results) - len(ok),
        "wall_s": round(phase.wall_s, 2),
        "requests_per_worker": spread,
        "workers": WORKER_LABELS[fleet],
    }


def table(rows: list[dict[str, Any]]) -> str:
    header = (
        f"{'fleet':<14} {'policy':<16} {'output tok/s':>12} {'TTFT p50':>9} {'TTFT p99':>9} "
        f"{'completed':>9} {'failed':>6}   requests per worker"
    )
    lines = [header, "-" * len(header)]
    for r in rows:
        lines.append(
            f"{r['fleet']:<14} {r['policy']:<16} {r['output_tok_s']:>12.0f} "
            f"{r['ttft_p50_ms']:>7.0f}ms {r['ttft_p99_ms']:>7.0f}ms {r['completed']:>9} "
            f"{r['failed']:>6}   {r['requests_per_worker']}"
        )
    return "\n".join(lines)


def verdicts(rows: list[dict[str, Any]], policy: str = "spare_capacity") -> list[str]:
    """The new policy against ``least_inflight``, per fleet."""
    out = []
    for fleet in FLEETS:
        by = {r["policy"]: r for r in rows if r["fleet"] == fleet}
        if policy not in by or "least_inflight" not in by:
            continue
        new, base = by[policy], by["least_inflight"]
        tok = new["output_tok_s"] / base["output_tok_s"] - 1 if base["output_tok_s"] else math.nan
        p99 = 1 - new["ttft_p99_ms"] / base["ttft_p99_ms"] if base["ttft_p99_ms"] else math.nan
        out.append(
            f"{fleet}: {policy} vs least_inflight: output tok/s {tok:+.1%}, TTFT p99 {-p99:+.1%}"
        )
    return out


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """The table ``docs/benchmarks.md`` shows beside the plot."""
    lines = [
        "| fleet | policy | output tok/s | TTFT p50 | TTFT p99 | completed | requests per worker |",
        "|---|---|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        spread = " / ".join(str(n) for n in r["requests_per_worker"])
        lines.append(
            f"| {r['fleet']} | `{r['policy']}` | {r['output_tok_s']:.0f} | "
            f"{r['ttft_p50_ms']:.0f} ms | {r['ttft_p99_ms']:.0f} ms | {r['completed']} | {spread} |"
        )
    return "\n".join(lines)


def write_png(path: Path, rows: list[dict[str, Any]]) -> str | None:
    """The plot, as PNG or SVG by ``path``'s suffix; returns a reason when none was drawn."""
    try:
        plt = figures.pyplot()
    except ImportError:
        return "matplotlib is not installed"
    fleets = [f for f in FLEETS if any(r["fleet"] == f for r in rows)]
    fig, axes = plt.subplots(len(fleets), 2, figsize=(11, 3.4 * len(fleets)), squeeze=False)
    for row_axes, fleet in zip(axes, fleets, strict=True):
        runs = [r for r in rows if r["fleet"] == fleet]
        names = [r["policy"] for r in runs]
        row_axes[0].bar(names, [r["output_tok_s"] for r in runs], color="tab:blue")
        row_axes[0].set_title(f"{fleet}: fleet output tok/s")
        row_axes[1].bar(names, [r["ttft_p99_ms"] for r in runs], color="tab:red", label="p99")
        row_axes[1].bar(names, [r["ttft_p50_ms"] for r in runs], color="tab:orange", label="p50")
        row_axes[1].set_title(f"{fleet}: TTFT (ms)")
        row_axes[1].legend()
        for ax in row_axes:
            ax.tick_params(axis="x", labelrotation=20)
    fig.tight_layout()
    figures.save(fig, path)
    plt.close(fig)
    return None


def main(args: argparse.Namespace) -> int:
    if args.replot is not None:
        data = json.loads(args.replot.read_text(encoding="utf-8"))
        return report(data, args)
    started = time.time()
    prompts, used = prompt_mix(args.datasets_dir, args.num_prompts)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    fleets = [f.strip() for f in args.fleets.split(",") if f.strip()]
    rows = []
    for fleet in fleets:
        for policy in policies:
            row = measure(fleet, policy, prompts, args)
            print(
                f"{fleet} {policy}: {row['output_tok_s']:.0f} tok/s, "
                f"TTFT p99 {row['ttft_p99_ms']:.0f} ms",
                flush=True,
            )
            rows.append(row)
    print()
    print(table(rows))
    for line in verdicts(rows):
        print(line)
    meta = {
        "concurrency": args.concurrency,
        "num_prompts": args.num_prompts,
        "max_tokens": args.max_tokens,
        "speed": args.speed,
        "loads_interval_s": args.loads_interval_s,
        "datasets": used,
        "stream": True,
        "thinking": False,
        "started_unix": round(started, 3),
        "duration_s": round(time.time() - started, 3),
        "argv": sys.argv[1:],
    }
    args.out.mkdir(parents=True, exist_ok=True)
    data = {"meta": meta, "runs": rows, "verdicts": verdicts(rows)}
    (args.out / "routing.json").write_text(json.dumps(data, indent=2) + "\n")
    print(f"\nwrote {args.out / 'routing.json'}")
    return report(data, args)


def report(data: dict[str, Any], args: argparse.Namespace) -> int:
    """Draw the run's plot into ``--out`` and, with ``--docs``, publish it for the docs."""
    rows: list[dict[str, Any]] = data["runs"]
    why = write_png(args.out / "routing.png", rows)
    print(f"wrote {args.out / 'routing.png'}" if why is None else f"no chart: {why}")
    if args.docs:
        if why is not None:
            print(f"--docs: no plot to publish ({why})", file=sys.stderr)
            return 1
        write_png(figures.DOCS_IMG / "routing.svg", rows)
        figures.publish_json("routing", data)
        print(
            f"wrote {figures.DOCS_IMG / 'routing.svg'} and routing.json; the page's table "
            f"(measured {figures.run_date(data['meta'])}):\n"
        )
        print(markdown_table(rows))
    failed = sum(r["failed"] for r in rows)
    if failed:
        print(f"{failed} request(s) failed", file=sys.stderr)
    return 0 if rows and not failed else 1
